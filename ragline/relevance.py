"""Is a passage relevant enough to answer from? (placeholder: calibrated below)"""
def threshold() -> float:
    return 0.0
