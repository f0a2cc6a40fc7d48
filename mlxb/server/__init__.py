"""mlxb.server"""
