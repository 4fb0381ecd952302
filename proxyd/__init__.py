"""proxyd: the asyncio HTTP front door (OpenAI API, ladders, caps, counters)."""
