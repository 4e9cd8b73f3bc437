"""ncclwatch.dashboards"""
