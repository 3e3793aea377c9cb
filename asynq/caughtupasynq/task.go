package caughtupasynq

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/internal/tracing"
	"github.com/caughtup/caughtup/internal/weakkey"
	"github.com/caughtup/caughtup/position"
)

// HeaderDedup says whether a task may stand for later enqueues that asynq
// rejected as duplicates (asynq.Unique, asynq.TaskID), whose writes its
// own token does not cover: "1" when it was enqueued with one of those
// options, "0" when Client enqueued it and saw that it was not. The
// middleware routes a task that may be deduplicated against the primary's
// position at the start of each attempt (see Middleware). A task that
// carries a token and no HeaderDedup went through a plain *asynq.Client or
// an asynq.Scheduler, whose enqueue options caughtup cannot see: it counts
// as "1".
const HeaderDedup = "caughtup-dedup"

// mayBeDeduplicated reports whether a task with headers h may stand for
// enqueues asynq rejected as duplicates (HeaderDedup).
func mayBeDeduplicated(h map[string]string) bool {
	switch h[HeaderDedup] {
	case "1":
		return true
	case "0":
		return false
	}
	return h[position.HeaderName] != ""
}

// HeaderDeadline carries the task's absolute deadline (asynq.Deadline) the
// way asynq stores it: Unix seconds, "0" for none. Client writes it next to
// the token, from the options the task is enqueued with, because asynq
// gives a handler only min(Deadline, start of the attempt + Timeout) as its
// context's deadline and the middleware must not mistake a Timeout, which
// restarts with every attempt, for a deadline that deferral could miss
// (see Middleware).
const HeaderDeadline = "caughtup-deadline"

// ErrForeignTask is returned by Client when a task built by asynq.NewTask or
// asynq.NewTaskWithHeaders needs a token. asynq keeps the options given to
// those functions where no one else can read them, and headers can only be
// set when a task is built, so stamping such a task means rebuilding it
// without its options (Queue, MaxRetry, Timeout, Deadline, Unique, …). The
// Client refuses instead of losing them or enqueueing the task unstamped.
// Build the task with this package's NewTask or NewTaskWithHeaders: same
// arguments, plus the context.
var ErrForeignTask = errors.New("caughtup/asynq: the task was built by asynq.NewTask or asynq.NewTaskWithHeaders, whose options cannot be read back, so it cannot be stamped without losing them; build it with caughtupasynq.NewTask(ctx, typename, payload, opts...) or caughtupasynq.NewTaskWithHeaders instead")

// known holds the options of the tasks this package built (NewTask,
// NewTaskWithHeaders, Client's stamped copies), so that Client and the
// GroupAggregator hook can rebuild them with more headers and every
// option. Entries go away with their tasks (weakkey): the registry holds
// no more than the live tasks this package built.
var known weakkey.Map[asynq.Task, built]

// built is what this package knows of a task it built: its options, and
// the token it merged into the task's header, so that Client, given the
// same token, neither decodes the header nor encodes it again.
type built struct {
	opts    []asynq.Option
	stamped position.Token
}

// NewTask is asynq.NewTask for tasks that carry a token: it records the
// options, so that Client can stamp the task without losing them, and
// stamps the task with the token ctx carries (enqueue.TokenFrom), so that
// it also goes stamped through a plain *asynq.Client or an
// asynq.Scheduler. Build every task that goes through Client with it (or
// NewTaskWithHeaders):
//
//	func welcome(ctx context.Context, client *caughtupasynq.Client, payload []byte) error {
//		task := caughtupasynq.NewTask(ctx, "email:welcome", payload, asynq.MaxRetry(5))
//		_, err := client.EnqueueContext(ctx, task)
//		return err
//	}
//
// A task with asynq.Unique or asynq.TaskID also gets HeaderDedup. Enqueued
// through a plain *asynq.Client or an asynq.Scheduler, whose enqueue
// options (Unique, TaskID among them) caughtup cannot see, a stamped task
// is routed as one that may be deduplicated: against the primary's
// position at the start of each attempt, one round trip to the primary
// per attempt. Client knows the options and spares that. A
// token that cannot be encoded (more than position.MaxDatabases
// databases) is left out, so the consumer reads the primary; Client
// returns that error when the task goes through it.
func NewTask(ctx context.Context, typename string, payload []byte, opts ...asynq.Option) *asynq.Task {
	return NewTaskWithHeaders(ctx, typename, payload, nil, opts...)
}

// NewTaskWithHeaders is asynq.NewTaskWithHeaders for tasks that carry a
// token, as NewTask: the token ctx carries is merged into the
// position.HeaderName header of headers (position.MergeHeader: a value
// that does not decode stays as it is). headers is copied, not kept.
//
// The trace context of ctx goes into the headers too, through the global
// propagators (otel.SetTextMapPropagator; the default propagates
// nothing), so that the task's spans on the worker continue the trace of
// the request that enqueued it (MiddlewareConfig.Propagators). Headers
// the caller set, a traceparent of its own among them, are kept.
func NewTaskWithHeaders(ctx context.Context, typename string, payload []byte, headers map[string]string, opts ...asynq.Option) *asynq.Task {
	opts = slices.Clip(opts)
	tok, _ := enqueue.TokenFrom(ctx)
	old := headers[position.HeaderName]
	text, err := position.MergeHeader(old, tok)
	if err != nil {
		text = old
	}
	dedup := dedupOption(opts) && headers[HeaderDedup] == ""
	traceFields := newFields(headers, tracing.Fields(ctx, otel.GetTextMapPropagator()))
	if text != old || dedup || len(traceFields) > 0 {
		h := make(map[string]string, len(headers)+2+len(traceFields))
		maps.Copy(h, traceFields)
		maps.Copy(h, headers)
		if text != "" {
			h[position.HeaderName] = text
		}
		if dedup {
			h[HeaderDedup] = "1"
		}
		headers = h
	}
	task := asynq.NewTaskWithHeaders(typename, payload, headers, opts...)
	if text == old {
		tok = position.Token{} // not merged: Client must merge it
	}
	known.Store(task, built{opts: opts, stamped: tok})
	return task
}

// optionsOf returns the options task was built with, if they are known:
// those of a task this package built, and none for a task asynq's server
// handed to a handler (the only tasks with a ResultWriter: asynq builds
// them from the stored message, without options, so re-enqueueing one
// through asynq's own Client applies only the enqueue's options too).
func optionsOf(task *asynq.Task) ([]asynq.Option, bool) {
	b, ok := builtOf(task)
	return b.opts, ok
}

// builtOf is optionsOf with the token NewTask merged into the header.
func builtOf(task *asynq.Task) (built, bool) {
	if b, ok := known.Load(task); ok {
		return b, true
	}
	if task.ResultWriter() != nil {
		return built{}, true
	}
	return built{}, false
}

// sameToken reports whether a and b are the same token: merging one into
// a header that already holds the other changes nothing.
func sameToken(a, b position.Token) bool {
	return a.CapturedAt.Equal(b.CapturedAt) && slices.Equal(a.Entries, b.Entries)
}

// dedupOption reports whether opts make asynq reject later enqueues of the
// same task (Unique) or id (TaskID).
func dedupOption(opts []asynq.Option) bool {
	for _, o := range opts {
		if o == nil {
			continue
		}
		switch o.Type() {
		case asynq.UniqueOpt, asynq.TaskIDOpt:
			return true
		}
	}
	return false
}

// deadlineValue is HeaderDeadline's value for a task enqueued with the
// options of each list in turn: the last asynq.Deadline wins, as in
// asynq's Client, and is stored in whole seconds as asynq stores it.
func deadlineValue(lists ...[]asynq.Option) string {
	var dl time.Time
	for _, opts := range lists {
		for _, o := range opts {
			if o == nil || o.Type() != asynq.DeadlineOpt {
				continue
			}
			if t, ok := o.Value().(time.Time); ok {
				dl = t
			}
		}
	}
	if dl.IsZero() {
		return "0"
	}
	return strconv.FormatInt(dl.Unix(), 10)
}

// parseDeadline reads a HeaderDeadline value: the deadline, whether the
// task has one, and whether the value is readable.
func parseDeadline(v string) (time.Time, bool, bool) {
	sec, err := strconv.ParseInt(v, 10, 64)
	switch {
	case err != nil || sec < 0:
		return time.Time{}, false, false
	case sec == 0:
		return time.Time{}, false, true
	}
	return time.Unix(sec, 0), true, true
}

// headerEdit is what stamping changes in a task's headers.
type headerEdit struct {
	token    string // the token header's new value; "" deletes it
	setToken bool
	dedup    string // HeaderDedup's new value, "0" or "1"; "" leaves it
	deadline string // HeaderDeadline's new value; "" deletes it
	setDL    bool
}

func (e headerEdit) empty() bool { return !e.setToken && e.dedup == "" && !e.setDL }

// apply returns h with e applied, as a new map.
func (e headerEdit) apply(h map[string]string) map[string]string {
	out := make(map[string]string, len(h)+3)
	maps.Copy(out, h)
	e.applyInPlace(out)
	return out
}

func (e headerEdit) applyInPlace(h map[string]string) {
	if e.setToken {
		if e.token == "" {
			delete(h, position.HeaderName)
		} else {
			h[position.HeaderName] = e.token
		}
	}
	if e.dedup != "" {
		h[HeaderDedup] = e.dedup
	}
	if e.setDL {
		if e.deadline == "" {
			delete(h, HeaderDeadline)
		} else {
			h[HeaderDeadline] = e.deadline
		}
	}
}

// rebuild returns a task like task, whose options are own, with e applied
// to its headers; record records the new task's options too, for tasks
// that may be stamped again.
func rebuild(task *asynq.Task, own []asynq.Option, e headerEdit, record bool) *asynq.Task {
	// own is clipped (NewTaskWithHeaders clips it; nil otherwise), so that
	// asynq's append of the enqueue options never writes into a shared
	// backing array.
	out := asynq.NewTaskWithHeaders(task.Type(), task.Payload(), e.apply(task.Headers()), own...)
	if record {
		known.Store(out, built{opts: own})
	}
	return out
}

// stamp returns the task to enqueue in place of task, with enqueue options
// enq: task itself when there is nothing to add, else a new task with the
// same type, payload, headers and options whose token header is tok
// merged into task's (position.MergeHeader), with HeaderDedup ("1" when
// the options ask for deduplication, "0" when they are known and do not)
// and HeaderDeadline next to a token. task is
// never modified. A change to a task whose options are unknown is refused
// (ErrForeignTask). record records the new task's options, for a stamped
// task that is stamped again.
func stamp(task *asynq.Task, tok position.Token, enq []asynq.Option, record bool) (*asynq.Task, error) {
	b, ok := builtOf(task)
	own := b.opts
	h := task.Headers()
	old := h[position.HeaderName]
	text := old
	// A task NewTask stamped with this very token (the same context's)
	// already holds it: the header is neither decoded nor encoded again.
	if !sameToken(tok, b.stamped) {
		var err error
		if text, err = position.MergeHeader(old, tok); err != nil {
			return nil, fmt.Errorf("caughtup/asynq: cannot stamp task %q: %w", task.Type(), err)
		}
	}
	var e headerEdit
	if text != old {
		e.token, e.setToken = text, true
	}
	// Without a token the marker only lets the task use a replica that
	// has the primary's current position instead of the primary itself:
	// worth it for a task that is rebuilt anyway, not a reason to refuse
	// a foreign one.
	switch {
	case h[HeaderDedup] == "1":
	case (dedupOption(own) || dedupOption(enq)) && (ok || text != ""):
		e.dedup = "1"
	case ok && text != "" && h[HeaderDedup] != "0":
		// Every option is known and none deduplicates: the middleware
		// need not read the primary's position for this task.
		e.dedup = "0"
	}
	if ok && text != "" {
		if dl := deadlineValue(own, enq); h[HeaderDeadline] != dl {
			e.deadline, e.setDL = dl, true
		}
	}
	switch {
	case e.empty():
		return task, nil
	case !ok:
		return nil, fmt.Errorf("%w (task type %q)", ErrForeignTask, task.Type())
	}
	return rebuild(task, own, e, record), nil
}

// newFields returns the entries of fields whose keys headers lacks.
func newFields(headers, fields map[string]string) map[string]string {
	for k := range fields {
		if _, ok := headers[k]; ok {
			delete(fields, k)
		}
	}
	return fields
}
