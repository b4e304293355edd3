"""fedlpa"""
