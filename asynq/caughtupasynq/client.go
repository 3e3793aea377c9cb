package caughtupasynq

import (
	"context"
	"errors"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// Enqueuer is the part of *asynq.Client that stamping wraps. Client
// implements it too, so wrappers compose.
type Enqueuer interface {
	EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error)
}

var (
	_ Enqueuer = (*asynq.Client)(nil)
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
// header (position.MergeHeader), so a task re-enqueued from a handler
// keeps the furthest position per database. The caller's task is not
// modified: a stamped copy with the same options is enqueued.
//
// Build the task with NewTask or NewTaskWithHeaders. A task built by
// asynq.NewTask or asynq.NewTaskWithHeaders that needs a token is refused
// with ErrForeignTask, because asynq cannot give its options back; one
// that needs nothing (ctx carries no token, or nothing its header does not
// already hold) is enqueued as it is. The task a handler received from
// asynq can be enqueued again: asynq built it without options.
//
// A ctx without a token enqueues the task without one; the consumer reads
// the primary for it and counts it (outcome primary_no_token).
//
// Options work as in asynq, given to NewTask or here (the later wins).
// Next to a token the Client writes HeaderDeadline from them, and
// HeaderDedup: "1" for asynq.Unique or asynq.TaskID, "0" otherwise, which
// spares the middleware the primary round trip it makes for a task whose
// options it cannot know (see Middleware).
//
// Errors from asynq are unchanged. asynq.ErrDuplicateTask and
// asynq.ErrTaskIDConflict mean that a task with the same key or id already
// exists; whether it does this caller's work depends on its state:
//
//   - pending, scheduled, retry or aggregating: it has not started its
//     next attempt, and the middleware routes that attempt against the
//     primary's position read when it starts, so it sees this caller's
//     writes.
//   - active: it started before this caller's write, and that run does not
//     see it. Only a later attempt (a retry) would. Enqueue again once it
//     is done, under another id or after its uniqueness lock ends, if the
//     work must see the write.
//   - completed (kept by asynq.Retention) or archived: it will not run
//     again by itself; the work is not done for this caller.
//
// asynq's Inspector.GetTaskInfo tells the state of a TaskID conflict.
func (c *Client) EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	tok, _ := enqueue.TokenFrom(ctx)
	return c.EnqueueToken(ctx, tok, task, opts...)
}

// EnqueueToken is EnqueueContext with an explicit token instead of the
// context's (tokens of CDC events, or of work done on another context).
// tok is merged with the token already in the task's header; the zero
// Token adds nothing.
func (c *Client) EnqueueToken(ctx context.Context, tok position.Token, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	if task == nil {
		return nil, errors.New("caughtup/asynq: task cannot be nil")
	}
	// The stamped copy goes to next and no further; only a Client behind
	// this one stamps it again and needs its options.
	_, again := c.next.(*Client)
	stamped, err := stamp(task, tok, opts, again)
	if err != nil {
		return nil, err
	}
	return c.next.EnqueueContext(ctx, stamped, opts...)
}
