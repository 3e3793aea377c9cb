// Package helper builds and enqueues tasks for package app: the analyzer
// follows tasks across packages through its facts.
package helper

import (
	"context"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
)

// Welcome builds a task the caughtup client refuses.
func Welcome(id string) *asynq.Task { // want Welcome:"buildsForeign\\[0\\]"
	return asynq.NewTask("email:welcome", []byte(id), asynq.MaxRetry(5))
}

// Stamped builds a task the caughtup client stamps.
func Stamped(ctx context.Context, id string) *asynq.Task {
	return caughtupasynq.NewTask(ctx, "email:welcome", []byte(id))
}

// WithErr returns a foreign task as its first result.
func WithErr(id string) (*asynq.Task, error) { // want WithErr:"buildsForeign\\[0\\]"
	return asynq.NewTaskWithHeaders("email:welcome", []byte(id), map[string]string{"k": "v"}), nil
}

// Send enqueues its task through the caughtup client.
func Send(ctx context.Context, c *caughtupasynq.Client, t *asynq.Task) error { // want Send:"enqueues\\[2\\]"
	_, err := c.EnqueueContext(ctx, t)
	return err
}

// Sender holds a client; its method enqueues the task of its parameter.
type Sender struct{ C *caughtupasynq.Client }

// Send enqueues t.
func (s Sender) Send(ctx context.Context, t *asynq.Task) error { // want Send:"enqueues\\[1\\]"
	_, err := s.C.EnqueueContext(ctx, t)
	return err
}
