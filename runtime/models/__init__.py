"""deltafin.runtime.models"""
