"""Fault-injection campaigns: the operator and the runtime under the failures they must survive."""
