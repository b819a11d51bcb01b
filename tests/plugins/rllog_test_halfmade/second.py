__all__ = ["SECOND"]
SECOND = 2
