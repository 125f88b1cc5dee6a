"""The Lua of per-key limits: one atomic call admits a request against all of its key's limits at
once (every gateway replica calls the same script on the same Redis keys, so they share them).

Keys (one hash tag per API key name, so a cluster keeps both in one slot):

    KEYS[1]  <prefix>:{<name>}:buckets   HASH  rl, rt (requests bucket: level, ms of last update)
                                               tl, tt (tokens bucket: the same)
    KEYS[2]  <prefix>:{<name>}:leases    ZSET  lease id -> expiry (ms, Redis clock)

A bucket holds up to ``rate`` units (a minute's worth) and refills continuously at rate / 60 s;
it starts full. Time is Redis's (TIME), the one clock all replicas share.

admit(rpm, tpm, max_concurrent, cost, lease_id, lease_ttl_ms) → reply
  rpm / tpm / max_concurrent: 0 = no such limit; cost: the tokens the request reserves.
  {'admitted', 0}: every bucket had enough; both were taken from, and the lease (when
      max_concurrent > 0) added with expiry now + lease_ttl_ms.
  {'rejected', limit, wait_ms}: nothing taken. ``limit`` is the limit that needs the longest wait,
      ``wait_ms`` that wait: a bucket's time to refill what the request lacks; for
      max_concurrent, the time until the earliest lease expires (a release may come sooner).
  {'too_large', 'tokens_per_minute', cost}: the request costs more than the bucket ever holds.
renew(lease_ttl_ms, lease ids...) → how many of them were still held (their expiry pushed back).
refund(tpm, tokens) → the tokens bucket's level after ``tokens`` went back into it (capped at tpm):
  what a request reserved and did not use. A missing hash reads as a full bucket: nothing to do.
"""

from __future__ import annotations

__all__ = ["ADMIT", "REFUND", "RENEW"]

ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, lease, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])

local function level(l_field, t_field, rate)
  local r = redis.call('HMGET', KEYS[1], l_field, t_field)
  local l, ts = tonumber(r[1]), tonumber(r[2])
  if not l or not ts then return rate end
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  return math.min(rate, l + elapsed * rate / 60000)
end

if tpm > 0 and cost > tpm then
  return {'too_large', 'tokens_per_minute', cost}
end

local limit, wait = nil, -1
local function need(name, ms)
  if ms > wait then limit, wait = name, ms end
end

local rl, tl
if rpm > 0 then
  rl = level('rl', 'rt', rpm)
  if rl < 1 then need('requests_per_minute', math.ceil((1 - rl) * 60000 / rpm)) end
end
if tpm > 0 then
  tl = level('tl', 'tt', tpm)
  if tl < cost then need('tokens_per_minute', math.ceil((cost - tl) * 60000 / tpm)) end
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    need('max_concurrent', math.max(1, tonumber(first[2]) - now))
  end
end
if limit then return {'rejected', limit, wait} end

if rpm > 0 then
  redis.call('HSET', KEYS[1], 'rl', string.format('%.6f', rl - 1), 'rt', now)
end
if tpm > 0 then
  redis.call('HSET', KEYS[1], 'tl', string.format('%.6f', tl - cost), 'tt', now)
end
if rpm > 0 or tpm > 0 then
  -- Idle for a minute, every bucket is full again: the hash can go (a missing one reads as full).
  redis.call('PEXPIRE', KEYS[1], 61000)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, lease)
  redis.call('PEXPIRE', KEYS[2], ttl + 1000)
end
return {'admitted', 0}
"""

REFUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
local r = redis.call('HMGET', KEYS[1], 'tl', 'tt')
local l, ts = tonumber(r[1]), tonumber(r[2])
if not l or not ts then return tostring(tpm) end
local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
l = math.min(tpm, l + elapsed * tpm / 60000 + tokens)
redis.call('HSET', KEYS[1], 'tl', string.format('%.6f', l), 'tt', now)
return string.format('%.6f', l)
"""

RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local held = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
    held = held + 1
  end
end
if held > 0 then redis.call('PEXPIRE', KEYS[1], ttl + 1000) end
return held
"""
