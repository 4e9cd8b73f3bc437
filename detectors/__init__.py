"""ncclwatch.detectors"""
