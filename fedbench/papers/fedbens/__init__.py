"""fedbens"""
