"""Fault-injection campaigns (`make chaos`): kill the runtime's processes and break its storage on purpose."""
