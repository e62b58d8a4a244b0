"""deltafin.workers"""
