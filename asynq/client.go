package asynq

import (
	"context"
	"errors"

	hasynq "github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// Enqueuer is the part of *asynq.Client that stamping wraps. Client
// implements it too, so wrappers compose.
type Enqueuer interface {
	EnqueueContext(ctx context.Context, task *hasynq.Task, opts ...hasynq.Option) (*hasynq.TaskInfo, error)
}

var (
	_ Enqueuer = (*hasynq.Client)(nil)
	_ Enqueuer = (*Client)(nil)
)

// Client stamps every task it enqueues with the token of the writes
// before it, then enqueues it through the asynq client it wraps. asynq's
// Client has no middleware, hence the wrapper. It is safe for concurrent
// use.
type Client struct {
	next Enqueuer
}

// NewClient wraps next, usually an *asynq.Client. The Client does not own
// next: close the asynq client yourself.
func NewClient(next Enqueuer) *Client {
	if next == nil {
		panic("caughtup/asynq: NewClient with a nil Enqueuer")
	}
	return &Client{next: next}
}

// EnqueueContext enqueues task stamped with the token ctx carries
// (enqueue.TokenFrom: what enqueue.Commit, enqueue.InTx or a routed
// handler's context hold), merged with any token already in the task's
// header, so a task re-enqueued from a handler keeps the furthest
// position per database. Options work as in asynq, whether given to
// asynq.NewTask or here. The caller's task is not modified: a stamped copy
// is enqueued.
//
// A ctx without a token enqueues the task as it is; the consumer reads
// the primary for it and counts it (outcome primary_no_token).
//
// Tasks with asynq.Unique or asynq.TaskID also get HeaderDedup. Errors are
// asynq's, unchanged: asynq.ErrDuplicateTask and asynq.ErrTaskIDConflict
// mean the task that is already queued will do the work, and the
// middleware routes that task against the primary's position when it
// starts, so it sees this caller's writes too (see Middleware).
func (c *Client) EnqueueContext(ctx context.Context, task *hasynq.Task, opts ...hasynq.Option) (*hasynq.TaskInfo, error) {
	tok, _ := enqueue.TokenFrom(ctx)
	return c.EnqueueToken(ctx, tok, task, opts...)
}

// EnqueueToken is EnqueueContext with an explicit token instead of the
// context's (tokens of CDC events, or of work done on another context).
// tok is merged with the token already in the task's header; the zero
// Token adds nothing.
func (c *Client) EnqueueToken(ctx context.Context, tok position.Token, task *hasynq.Task, opts ...hasynq.Option) (*hasynq.TaskInfo, error) {
	if task == nil {
		return nil, errors.New("caughtup/asynq: task cannot be nil")
	}
	dedup := dedupOption(opts)
	if !dedup {
		if own, ok := taskOptions(task); ok {
			dedup = dedupOption(own)
		}
	}
	stamped, err := stamp(task, tok, dedup)
	if err != nil {
		return nil, err
	}
	return c.next.EnqueueContext(ctx, stamped, opts...)
}

// NewTask is asynq.NewTask stamped with the token ctx carries, for tasks
// that go through a plain *asynq.Client or asynq.Scheduler rather than a
// Client. A task made by it and enqueued through a Client is stamped again
// with the enqueue's context, which only raises the positions.
//
// A token that cannot be encoded (more than position.MaxDatabases
// databases) leaves the task without one, so the consumer reads the
// primary; Client.EnqueueContext returns that error instead.
func NewTask(ctx context.Context, typename string, payload []byte, opts ...hasynq.Option) *hasynq.Task {
	tok, _ := enqueue.TokenFrom(ctx)
	dedup := dedupOption(opts)
	if tok.IsZero() && !dedup {
		return hasynq.NewTask(typename, payload, opts...)
	}
	headers := make(map[string]string, 2)
	if text, err := tok.Encode(); err == nil && text != "" {
		headers[position.HeaderName] = text
	}
	if dedup {
		headers[HeaderDedup] = "1"
	}
	return hasynq.NewTaskWithHeaders(typename, payload, headers, opts...)
}
