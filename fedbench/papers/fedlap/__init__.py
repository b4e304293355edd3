"""fedlap"""
