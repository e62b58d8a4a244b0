"""deltafin.protocol"""
