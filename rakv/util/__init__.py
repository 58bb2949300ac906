"""Small shared helpers below everything else: paths and the cache folder, file locks, the device and
the clock, timing, token-id helpers, text input checks, argument types, acceptance bookkeeping."""
