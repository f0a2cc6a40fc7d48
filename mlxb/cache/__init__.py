"""mlxb.cache"""
