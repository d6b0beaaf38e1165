"""The disk cache of rewritten programs: stable fingerprints of Python values and
programs (``fingerprint``) and the store with its key and serialisation (``store``).
"""
