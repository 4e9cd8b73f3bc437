"""ncclwatch.alerting"""
