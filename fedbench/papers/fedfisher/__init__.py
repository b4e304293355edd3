"""fedfisher"""
