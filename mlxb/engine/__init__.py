"""mlxb.engine"""
