"""deltafin.runtime"""
