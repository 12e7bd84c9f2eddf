"""The reliability campaign (`make chaos`): faults injected into the runtime and the operator, fuzzed specs,
the security checks, and the figures they add up to."""
