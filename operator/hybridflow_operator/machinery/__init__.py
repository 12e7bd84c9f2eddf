"""The generic controller machinery: nothing here knows what an RLTrainingJob is.

client (an asyncio Kubernetes client on plain dicts, requests capped in `slots`), informer (list and
watch of one kind into a callback), workqueue (one run at a time per key), ratelimit (a token bucket).
"""
