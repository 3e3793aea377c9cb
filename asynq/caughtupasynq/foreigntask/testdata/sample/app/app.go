// Package app hands caughtup's asynq client tasks of every origin.
package app

import (
	"context"

	"github.com/hibiken/asynq"

	"example.com/sample/helper"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/position"
)

func direct(ctx context.Context, c *caughtupasynq.Client) error {
	if _, err := c.EnqueueContext(ctx, asynq.NewTask("a", nil)); err != nil { // want `task built by asynq.NewTask at app.go:16 reaches caughtupasynq.Client`
		return err
	}
	t := asynq.NewTaskWithHeaders("b", nil, nil, asynq.Queue("q"))
	_, err := c.EnqueueContext(ctx, t, asynq.MaxRetry(1)) // want `task built by asynq.NewTaskWithHeaders at app.go:19`
	return err
}

func token(ctx context.Context, c *caughtupasynq.Client, tok position.Token) error {
	_, err := c.EnqueueToken(ctx, tok, asynq.NewTask("a", nil)) // want `asynq.NewTask at app.go:25`
	return err
}

func stamped(ctx context.Context, c *caughtupasynq.Client) error {
	t := caughtupasynq.NewTask(ctx, "a", nil, asynq.MaxRetry(5))
	if _, err := c.EnqueueContext(ctx, t); err != nil {
		return err
	}
	_, err := c.EnqueueContext(ctx, helper.Stamped(ctx, "1"))
	return err
}

// One branch builds a foreign task: the call may get it.
func branches(ctx context.Context, c *caughtupasynq.Client, urgent bool) error {
	t := caughtupasynq.NewTask(ctx, "a", nil)
	if urgent {
		t = asynq.NewTask("a", nil, asynq.Queue("critical"))
	}
	_, err := c.EnqueueContext(ctx, t) // want `asynq.NewTask at app.go:42`
	return err
}

// Tasks built and enqueued in other packages.
func helpers(ctx context.Context, c *caughtupasynq.Client) error {
	if _, err := c.EnqueueContext(ctx, helper.Welcome("1")); err != nil { // want `asynq.NewTask at helper.go:15`
		return err
	}
	t, err := helper.WithErr("2")
	if err != nil {
		return err
	}
	if _, err := c.EnqueueContext(ctx, t); err != nil { // want `asynq.NewTaskWithHeaders at helper.go:25`
		return err
	}
	if err := helper.Send(ctx, c, asynq.NewTask("c", nil)); err != nil { // want `asynq.NewTask at app.go:60`
		return err
	}
	s := helper.Sender{C: c}
	return s.Send(ctx, asynq.NewTask("d", nil)) // want `asynq.NewTask at app.go:64`
}

// enqueue hands its parameter to the client: its callers are checked.
func enqueue(ctx context.Context, c *caughtupasynq.Client, t *asynq.Task) error { // want enqueue:"enqueues\\[2\\]"
	_, err := c.EnqueueContext(ctx, t)
	return err
}

func local(ctx context.Context, c *caughtupasynq.Client) error {
	if err := enqueue(ctx, c, asynq.NewTask("a", nil)); err != nil { // want `asynq.NewTask at app.go:74`
		return err
	}
	return enqueue(ctx, c, caughtupasynq.NewTask(ctx, "a", nil))
}

// Closures: a task captured by value, and one assigned inside a closure.
func closures(ctx context.Context, c *caughtupasynq.Client) error {
	t := asynq.NewTask("a", nil)
	send := func() error {
		_, err := c.EnqueueContext(ctx, t) // want `asynq.NewTask at app.go:82`
		return err
	}
	if err := send(); err != nil {
		return err
	}
	var u *asynq.Task
	build := func() { u = asynq.NewTask("b", nil) }
	build()
	_, err := c.EnqueueContext(ctx, u) // want `asynq.NewTask at app.go:91`
	return err
}

// A closure hands a parameter of its enclosing function to the client.
func deferred(ctx context.Context, c *caughtupasynq.Client, t *asynq.Task) func() error { // want deferred:"enqueues\\[2\\]"
	return func() error {
		_, err := c.EnqueueContext(ctx, t)
		return err
	}
}

func useDeferred(ctx context.Context, c *caughtupasynq.Client) error {
	return deferred(ctx, c, asynq.NewTask("a", nil))() // want `asynq.NewTask at app.go:106`
}

// asynq's own client takes any task; a task a handler received was built
// by asynq's server without options, and the caughtup client takes it.
func plain(ctx context.Context, ac *asynq.Client, c *caughtupasynq.Client) asynq.Handler {
	if _, err := ac.EnqueueContext(ctx, asynq.NewTask("a", nil)); err != nil {
		panic(err)
	}
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		_, err := c.EnqueueContext(ctx, t)
		return err
	})
}

// A task the analyzer cannot follow (a field) is not reported.
type job struct{ task *asynq.Task }

func field(ctx context.Context, c *caughtupasynq.Client) error {
	j := job{task: asynq.NewTask("a", nil)}
	_, err := c.EnqueueContext(ctx, j.task)
	return err
}
