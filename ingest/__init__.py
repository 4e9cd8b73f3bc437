"""ncclwatch.ingest"""
