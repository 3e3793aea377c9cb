package caughtupasynq

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// wakeBatch bounds the tasks one wakeMoveScript call moves: a few
// milliseconds of Redis time at most, so that the script does not hold
// up the servers' own scripts (Redis runs one at a time).
const wakeBatch = 256

// wakeMoveScript moves the listed tasks of one queue from its retry set
// to pending, each only if asynq still shows it in the retry state with
// the retry count its deferral left. Checking and moving in one script
// closes the window that an Inspector.GetTaskInfo before an
// Inspector.RunTask leaves (see waker), and costs one round trip per
// wakeBatch tasks instead of four per task (two SISMEMBERs on asynq's
// queue set, GetTaskInfo's script, RunTask's).
//
// Key layout, copied from asynq v0.26.0 internal/base (TaskKey,
// RetryKey, PendingKey): the task hash asynq:{<queue>}:t:<id> (fields
// "state", "msg": the TaskMessage protobuf of internal/proto), the retry
// zset asynq:{<queue>}:retry and the pending list asynq:{<queue>}:pending,
// all in one Redis Cluster slot (the {<queue>} hash tag). The move itself
// is what asynq's forwarder (internal/rdb forwardCmd) does for a due
// task without a group: LPUSH pending, ZREM retry, HSET state pending and
// pending_since (Unix ns); RunTask (runTaskCmd) does the same for a
// grouped retry task, which is moved to pending too.
//
// The retry count is TaskMessage field 6 (int32 retried, a varint;
// absent when 0), read by walking the protobuf wire format.
//
// KEYS[1] asynq:{<queue>}:retry, KEYS[2] asynq:{<queue>}:pending;
// ARGV[1] asynq:{<queue>}:t: (the task key prefix), ARGV[2] now in Unix
// ns, then per task ARGV[2k+1] its id and ARGV[2k+2] its expected retry
// count. Returns one code per task (wakeMoved, …).
var wakeMoveScript = redis.NewScript(`
local function retried(msg)
	local i, n = 1, #msg
	local function varint()
		local v, m = 0, 1
		while i <= n do
			local b = string.byte(msg, i)
			i = i + 1
			v = v + (b % 128) * m
			if b < 128 then return v end
			m = m * 128
		end
		return nil
	end
	while i <= n do
		local tag = varint()
		if tag == nil then return nil end
		local field, wire = math.floor(tag / 8), tag % 8
		if wire == 0 then
			local v = varint()
			if v == nil then return nil end
			if field == 6 then return v end
		elseif wire == 1 then
			i = i + 8
		elseif wire == 2 then
			local l = varint()
			if l == nil then return nil end
			i = i + l
		elseif wire == 5 then
			i = i + 4
		else
			return nil
		end
	end
	if i == n + 1 then return 0 end
	return nil
end
local out = {}
for k = 3, #ARGV, 2 do
	local id = ARGV[k]
	local key = ARGV[1] .. id
	local state, msg = unpack(redis.call("HMGET", key, "state", "msg"))
	local code
	if not state then
		code = 0
	elseif state == "active" then
		code = -1
	elseif state == "pending" then
		code = -2
	elseif state == "completed" or state == "archived" then
		code = -3
	elseif state ~= "retry" or not msg or retried(msg) ~= tonumber(ARGV[k + 1]) then
		code = -4
	elseif redis.call("ZREM", KEYS[1], id) == 0 then
		code = -4
	else
		redis.call("LPUSH", KEYS[2], id)
		redis.call("HSET", key, "state", "pending", "pending_since", ARGV[2])
		code = 1
	end
	out[#out + 1] = code
end
return out
`)

// Codes wakeMoveScript returns per task.
const (
	wakeMoved       = 1
	wakeMissing     = 0  // no task hash: wakeNotFound
	wakeWasActive   = -1 // wakeActive
	wakeWasPending  = -2 // wakePending
	wakeWasFinished = -3 // completed or archived: wakeFinished
	wakeWasChanged  = -4 // another state or retry count: wakeChanged
)

// moveResult is what wakeMoveScript's code for one task means.
func moveResult(code int64) attemptResult {
	switch code {
	case wakeMoved:
		return attemptResult{woken: true}
	case wakeMissing:
		return attemptResult{err: wakeNotFound}
	case wakeWasActive:
		return attemptResult{err: wakeActive, retry: true}
	case wakeWasPending:
		return attemptResult{err: wakePending}
	case wakeWasFinished:
		return attemptResult{err: wakeFinished}
	default:
		return attemptResult{err: wakeChanged}
	}
}

// moveBatch moves es (at most wakeBatch tasks, all of queue) with one
// wakeMoveScript call and returns each one's result, in order.
func moveBatch(ctx context.Context, c redis.UniversalClient, queue string, es []*wakeEntry) []attemptResult {
	prefix := "asynq:{" + queue + "}:"
	args := make([]any, 0, 2+2*len(es))
	args = append(args, prefix+"t:", strconv.FormatInt(time.Now().UnixNano(), 10))
	for _, e := range es {
		args = append(args, e.Key.id, e.Data.retried)
	}
	out := make([]attemptResult, len(es))
	codes, err := wakeMoveScript.Run(ctx, c, []string{prefix + "retry", prefix + "pending"}, args...).Int64Slice()
	if err == nil && len(codes) != len(es) {
		err = fmt.Errorf("caughtup/asynq: the wake script returned %d codes for %d tasks", len(codes), len(es))
	}
	for i := range out {
		if err != nil {
			out[i] = attemptResult{err: wakeRedis, retry: true, cause: err}
			continue
		}
		out[i] = moveResult(codes[i])
	}
	return out
}
