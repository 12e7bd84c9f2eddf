"""The generic controller machinery, apart from what the operator does with it.

client (an asyncio Kubernetes client on plain dicts, requests capped in `slots`; its table of kinds
is the only thing it knows about ours), informer (list and watch of one kind into a callback),
workqueue (one run at a time per key), ratelimit (a token bucket).
"""
