import redis


def test_real_redis_answers(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        r.xadd(f"{key_prefix}:s", {"k": "v"})
        assert r.xlen(f"{key_prefix}:s") == 1
    finally:
        r.delete(f"{key_prefix}:s")
        r.close()
