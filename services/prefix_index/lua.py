"""The index's Lua: one atomic round trip per operation, the same bodies for EVALSHA (Redis < 7)
and for a server-side function library (Redis 7+, FUNCTION LOAD / FCALL).

Every script is called with KEYS[1] = the index's executors set (so a cluster routes the call to
the index's one slot; every other key is built from the prefix ARGV[1] and carries the same hash
tag) and ARGV[1] = the prefix, e.g. ``{llmserve:pi}``. The key layout is drawn in store.py.

Invariants the scripts keep (e an executor, m a model, h a block hash):
- e ∈ b:<m>:<h>  ⇔  h ∈ xb:<e> and x:<e>.model == m and x:<e> is not a tombstone;
- x:<e>.seq is the last batch of epoch x:<e>.epoch whose effects the entries hold (0: none yet);
- e ∈ executors  ⇔  x:<e> exists and is not a tombstone.

Block hashes are 63-bit integers: they stay strings here (a Lua number is a double and would round
them). Epochs compare as byte strings (``str_cmp``): Lua's ``<`` on strings uses the C library's
locale collation, not byte order.

Script contracts (ARGV after the prefix; every reply is a status word or a flat array):
- apply(executor, epoch, model, seq, ops...) → [status, the record's seq after the call]
  status: 'applied' | 'replay' | 'gap' | 'stale'
  ops: 'S' n h1..hn (stored) | 'R' n h1..hn (removed) | 'C' (all cleared), in event order.
  An epoch older than the record's, or the record's own epoch once it is a tombstone: 'stale'.
  A newer (or first) epoch is adopted first: the old entries are purged and the record says
  (epoch, seq 0). Then seq <= record seq: 'replay' (no write); seq > record seq + 1, or a model
  other than the epoch's: 'gap' (no write beyond the adoption); else the ops apply and seq is set.
- install(executor, epoch, model, seq, hashes...) → 'installed' | 'current' | 'stale'
  Replaces the executor's entries with ``hashes`` at (epoch, seq), clearing a tombstone; 'current'
  (no write) when the live record already has this epoch and model at seq or later; 'stale' when
  the record's epoch is newer.
- purge(executor, epoch or '', tombstone_ttl_s) → 'purged' | 'absent' | 'newer'
  Drops the executor's entries and leaves a tombstone record (dead=1, expiring) at the later of
  both epochs, so batches of a dead epoch still in the stream are dropped as 'stale' rather than
  bring it back. 'newer': the record's epoch is later than ``epoch`` (a restart owns it now; no
  write). 'absent': no live record (nothing to drop).
- observe(executor, epoch, model) → 'ok' | 'restarted' | 'dead' | 'stale' | 'unknown'
  A heartbeat: a newer epoch purges a live record's entries and is adopted ('restarted'; 'ok' if
  the old record was a tombstone); 'dead': this very epoch was purged as dead, yet it beats.
- match(model, hashes) → [executor, num_blocks, ...] for every executor holding a leading run
  (the first hash first): the holders of the first block, each with the length of its run in
  its held set. The hashes come in one argument, separated by spaces: redis-py packs a prompt's
  hundred-odd arguments in ~20x the time it packs one.
- stats() → [executors holding at least one block, (block, executor) entries]
- executors() → [executor, epoch, ...] of the live records.
"""

from __future__ import annotations

import hashlib

__all__ = ["FUNCTION_LIBRARY", "FUNCTION_NAMES", "LIBRARY_NAME", "READ_ONLY", "SCRIPTS", "VERSION"]

_PRELUDE = """
local function key_record(p, e) return p .. ':x:' .. e end
local function key_held(p, e) return p .. ':xb:' .. e end
local function key_block(p, m, h) return p .. ':b:' .. m .. ':' .. h end
local function key_executors(p) return p .. ':executors' end

local function str_cmp(a, b)
  if a == b then return 0 end
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      if x < y then return -1 else return 1 end
    end
  end
  if #a < #b then return -1 else return 1 end
end

local function read_record(p, e)
  local r = redis.call('HMGET', key_record(p, e), 'epoch', 'seq', 'model', 'dead')
  if not r[1] then return nil end
  return {epoch = r[1], seq = tonumber(r[2]) or 0, model = r[3] or '', dead = r[4] == '1'}
end

local function write_record(p, e, epoch, seq, model)
  local k = key_record(p, e)
  redis.call('HSET', k, 'epoch', epoch, 'seq', seq, 'model', model)
  redis.call('HDEL', k, 'dead')
  redis.call('PERSIST', k)
  redis.call('SADD', key_executors(p), e)
  return {epoch = epoch, seq = seq, model = model, dead = false}
end

-- Every (block, e) entry goes; the record stays as it is.
local function drop_entries(p, e, model)
  local held = key_held(p, e)
  local hashes = redis.call('SMEMBERS', held)
  for i = 1, #hashes do
    redis.call('SREM', key_block(p, model, hashes[i]), e)
  end
  redis.call('DEL', held)
end

-- The hashes argv[first..last] enter (cmd SADD) or leave (SREM) e's entries. The held set takes
-- them a chunk per call (unpack's limit is a few thousand values).
local function change_entries(cmd, p, e, model, argv, first, last)
  for j = first, last do redis.call(cmd, key_block(p, model, argv[j]), e) end
  for j = first, last, 1000 do
    redis.call(cmd, key_held(p, e), unpack(argv, j, math.min(j + 999, last)))
  end
end

-- How many of ``hashes``, from the first, are in the set ``held``: SMISMEMBER a chunk at a time
-- (Redis 6.2+), else (an older server answers it with an error) SISMEMBER a hash at a time.
local function leading_run(held, hashes)
  local n = 0
  for j = 1, #hashes, 1000 do
    local found = redis.pcall('SMISMEMBER', held, unpack(hashes, j, math.min(j + 999, #hashes)))
    if found.err then
      for i = j, #hashes do
        if redis.call('SISMEMBER', held, hashes[i]) == 0 then return n end
        n = n + 1
      end
      return n
    end
    for i = 1, #found do
      if found[i] == 0 then return n end
      n = n + 1
    end
  end
  return n
end

-- A newer epoch (or a first one) replaces whatever the record held.
local function adopt(p, e, rec, epoch, model)
  if rec then drop_entries(p, e, rec.model) end
  return write_record(p, e, epoch, 0, model)
end

-- The ops of argv[first..]: checked whole before anything is written (Redis does not roll a
-- script back on error).
local function check_ops(argv, first)
  local i = first
  while i <= #argv do
    local op = argv[i]
    if op == 'C' then
      i = i + 1
    elseif op == 'S' or op == 'R' then
      local n = tonumber(argv[i + 1])
      if not n or n < 0 or i + 1 + n > #argv then return false end
      i = i + 2 + n
    else
      return false
    end
  end
  return true
end
"""

_BODIES: dict[str, str] = {
    "apply": """
local p, e, epoch, model = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = tonumber(ARGV[5])
if not seq or not check_ops(ARGV, 6) then
  return redis.error_reply('ERR llmserve prefix index: malformed apply arguments')
end
local rec = read_record(p, e)
if rec then
  local c = str_cmp(epoch, rec.epoch)
  if c < 0 or (c == 0 and rec.dead) then return {'stale', rec.seq} end
  if c > 0 then rec = adopt(p, e, rec, epoch, model) end
else
  rec = adopt(p, e, nil, epoch, model)
end
if seq <= rec.seq then return {'replay', rec.seq} end
if seq > rec.seq + 1 or model ~= rec.model then return {'gap', rec.seq} end
local i = 6
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    drop_entries(p, e, model)
    i = i + 1
  else
    local n = tonumber(ARGV[i + 1])
    local cmd = 'SREM'
    if op == 'S' then cmd = 'SADD' end
    change_entries(cmd, p, e, model, ARGV, i + 2, i + 1 + n)
    i = i + 2 + n
  end
end
redis.call('HSET', key_record(p, e), 'seq', seq)
return {'applied', seq}
""",
    "install": """
local p, e, epoch, model = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = tonumber(ARGV[5])
if not seq then return redis.error_reply('ERR llmserve prefix index: malformed install') end
local rec = read_record(p, e)
if rec then
  local c = str_cmp(epoch, rec.epoch)
  if c < 0 then return 'stale' end
  if c == 0 and not rec.dead and rec.model == model and rec.seq >= seq then return 'current' end
  drop_entries(p, e, rec.model)
end
write_record(p, e, epoch, seq, model)
change_entries('SADD', p, e, model, ARGV, 6, #ARGV)
return 'installed'
""",
    "purge": """
local p, e, epoch, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local rec = read_record(p, e)
if not rec then return 'absent' end
if epoch ~= '' and str_cmp(epoch, rec.epoch) < 0 then return 'newer' end
local was_live = not rec.dead
drop_entries(p, e, rec.model)
local k = key_record(p, e)
if epoch ~= '' and str_cmp(epoch, rec.epoch) > 0 then redis.call('HSET', k, 'epoch', epoch) end
redis.call('HSET', k, 'dead', '1')
redis.call('SREM', key_executors(p), e)
redis.call('EXPIRE', k, ttl)
if was_live then return 'purged' end
return 'absent'
""",
    "observe": """
local p, e, epoch, model = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local rec = read_record(p, e)
if not rec then return 'unknown' end
local c = str_cmp(epoch, rec.epoch)
if c < 0 then return 'stale' end
if c > 0 then
  adopt(p, e, rec, epoch, model)
  if rec.dead then return 'ok' end
  return 'restarted'
end
if rec.dead then return 'dead' end
return 'ok'
""",
    "match": """
local p, model = ARGV[1], ARGV[2]
local hashes = {}
for h in string.gmatch(ARGV[3], '%d+') do hashes[#hashes + 1] = h end
local out = {}
if #hashes == 0 then return out end
-- Only an executor holding the first block has a run. Such an executor serves this model and is
-- live, so (the first invariant) a hash is in its held set exactly when it holds that block here:
-- its run is read from its held set in one call, not one call a block.
for _, e in ipairs(redis.call('SMEMBERS', key_block(p, model, hashes[1]))) do
  out[#out + 1] = e
  out[#out + 1] = leading_run(key_held(p, e), hashes)
end
return out
""",
    "stats": """
local p = ARGV[1]
local num_executors, num_entries = 0, 0
for _, e in ipairs(redis.call('SMEMBERS', key_executors(p))) do
  local n = redis.call('SCARD', key_held(p, e))
  if n > 0 then num_executors = num_executors + 1 end
  num_entries = num_entries + n
end
return {num_executors, num_entries}
""",
    "executors": """
local p = ARGV[1]
local out = {}
for _, e in ipairs(redis.call('SMEMBERS', key_executors(p))) do
  out[#out + 1] = e
  out[#out + 1] = redis.call('HGET', key_record(p, e), 'epoch') or ''
end
return out
""",
}

# Scripts that write nothing: registered as no-writes functions (callable on a replica).
READ_ONLY = frozenset({"match", "stats", "executors"})

# EVAL form: the prelude's locals, then the body, which reads the globals KEYS and ARGV.
SCRIPTS: dict[str, str] = {name: _PRELUDE + body for name, body in _BODIES.items()}

# The library name carries a digest of the code, so two versions of the service (a rolling
# upgrade) each call their own functions instead of replacing each other's.
VERSION = hashlib.sha1((_PRELUDE + "".join(_BODIES.values())).encode()).hexdigest()[:12]
LIBRARY_NAME = f"llmserve_pi_{VERSION}"
FUNCTION_NAMES: dict[str, str] = {name: f"{LIBRARY_NAME}_{name}" for name in _BODIES}


def _register(name: str) -> str:
    # The callback's parameters are named KEYS and ARGV, so a body reads them as in EVAL.
    flags = "{'no-writes'}" if name in READ_ONLY else "{}"
    return (
        f"redis.register_function{{function_name='{FUNCTION_NAMES[name]}', flags={flags}, "
        f"callback=function(KEYS, ARGV)\n{_BODIES[name]}end}}\n"
    )


# Function form (Redis 7+): the prelude once, then one registration per script.
FUNCTION_LIBRARY = (
    f"#!lua name={LIBRARY_NAME}\n" + _PRELUDE + "".join(_register(name) for name in _BODIES)
)
