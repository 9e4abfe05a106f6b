"""Infrastructure the processes stand on: the Redis client and a Redis server of our own, and the
uvicorn host (signals, drain) with its connection bounds. Imports only core/ and config/."""
