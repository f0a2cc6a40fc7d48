"""mlxb.bench"""
