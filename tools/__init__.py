"""deltafin.tools"""
