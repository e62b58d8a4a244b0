"""deltafin.configs"""
