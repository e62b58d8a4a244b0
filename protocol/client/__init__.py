"""deltafin.client"""
