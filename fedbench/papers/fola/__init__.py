"""fola"""
