package asynq

import (
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"sync"
	"unsafe"

	hasynq "github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/position"
)

// HeaderDedup marks a task enqueued with asynq.Unique or asynq.TaskID. Such
// a task may stand for later enqueues that asynq rejected as duplicates,
// whose writes its own token does not cover, so the middleware routes it
// against the primary's position at the start of each attempt (see
// Middleware). The value is "1".
const HeaderDedup = "caughtup-dedup"

// optsOffset is where asynq.Task keeps the options given to NewTask.
// asynq v0.26 has no accessor for them, and a stamped task has to be
// rebuilt with NewTaskWithHeaders (Task.Headers of a NewTask task is nil,
// and the map of a NewTaskWithHeaders task is shared with every other
// enqueue of it), so the options are read where asynq keeps them. The
// field is found by name and checked by type when the package loads; if
// a future asynq renames or retypes it, optsOK is false and stamping
// leaves such tasks alone rather than drop their options (TestTaskLayout
// fails first).
var optsOffset, optsOK = func() (uintptr, bool) {
	f, ok := reflect.TypeFor[hasynq.Task]().FieldByName("opts")
	if !ok || f.Type != reflect.TypeFor[[]hasynq.Option]() {
		return 0, false
	}
	return f.Offset, true
}()

// taskOptions returns the options task was built with. The slice is
// asynq's own: callers must not modify it.
func taskOptions(task *hasynq.Task) ([]hasynq.Option, bool) {
	if !optsOK {
		return nil, false
	}
	return *(*[]hasynq.Option)(unsafe.Add(unsafe.Pointer(task), optsOffset)), true
}

var layoutWarning sync.Once

// dedupOption reports whether opts make asynq reject later enqueues of the
// same task (Unique) or id (TaskID).
func dedupOption(opts []hasynq.Option) bool {
	for _, o := range opts {
		if o == nil {
			continue
		}
		switch o.Type() {
		case hasynq.UniqueOpt, hasynq.TaskIDOpt:
			return true
		}
	}
	return false
}

// stamp returns the task to enqueue in place of task: task itself when
// there is nothing to add, else a new task with the same type, payload,
// headers and options whose token header is tok merged with the token task
// already carries, and the dedup marker when dedup is set. task is never
// modified.
//
// A token header that does not decode is kept as it is: the consumer
// then reads the primary, which is safe whatever tok says.
func stamp(task *hasynq.Task, tok position.Token, dedup bool) (*hasynq.Task, error) {
	h := task.Headers()
	old := h[position.HeaderName]
	needDedup := dedup && h[HeaderDedup] == ""
	if tok.IsZero() && !needDedup {
		return task, nil
	}
	text := old
	if !tok.IsZero() {
		merged := tok
		if old != "" {
			prev, err := position.Decode(old)
			if err != nil {
				// Unknown stays unknown: the consumer reads the primary.
				merged = position.Token{}
			} else {
				merged = prev.Merge(tok)
			}
		}
		if !merged.IsZero() {
			var err error
			if text, err = merged.Encode(); err != nil {
				return nil, fmt.Errorf("caughtup/asynq: cannot stamp task %q: %w", task.Type(), err)
			}
		}
	}
	if text == old && !needDedup {
		return task, nil
	}
	opts, ok := taskOptions(task)
	if !ok {
		layoutWarning.Do(func() {
			slog.Warn("caughtup/asynq: this asynq version keeps task options where caughtup cannot read them; tasks are enqueued unstamped and read the primary")
		})
		return task, nil
	}
	headers := make(map[string]string, len(h)+2)
	maps.Copy(headers, h)
	if text != "" {
		headers[position.HeaderName] = text
	}
	if needDedup {
		headers[HeaderDedup] = "1"
	}
	// Clip, so that asynq's append of the enqueue options to the task's
	// never writes into the caller's backing array.
	return hasynq.NewTaskWithHeaders(task.Type(), task.Payload(), headers, slices.Clip(opts)...), nil
}

// unstamp returns task without a token header (the consumer reads the
// primary), keeping everything else.
func unstamp(task *hasynq.Task) *hasynq.Task {
	h := task.Headers()
	if _, ok := h[position.HeaderName]; !ok {
		return task
	}
	// Without the options (an asynq whose layout is unknown) the task is
	// still rebuilt: a token that may not cover the whole group is worse
	// than lost options.
	opts, _ := taskOptions(task)
	headers := maps.Clone(h)
	delete(headers, position.HeaderName)
	return hasynq.NewTaskWithHeaders(task.Type(), task.Payload(), headers, slices.Clip(opts)...)
}
