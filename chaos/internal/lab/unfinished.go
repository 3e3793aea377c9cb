package lab

import (
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"
)

// maxExplained bounds how many unfinished jobs of a stream the run
// explains one by one.
const maxExplained = 10

// listPage is how many tasks asynqTasksByJob asks the Inspector for at once.
const listPage = 500

// explainUnfinished says, for the jobs the drain gave up on, how far each
// got: how many routing attempts began, and for asynq where its task is in
// Redis (the state, an orphaned lease, the retry count, the last error).
// A job that is missing from the table would otherwise say nothing about
// whether the queue lost it, holds it for later, or nobody works on it.
func (r *run) explainUnfinished() {
	for _, st := range r.streams() {
		ids, attempts := st.unfinished()
		if len(ids) == 0 {
			continue
		}
		var where map[int64]*asynq.TaskInfo
		if st == r.ast && r.inspector != nil {
			var err error
			if where, err = asynqTasksByJob(r.inspector, r.queue); err != nil {
				r.event("%s: could not list the queue's tasks: %v", st.name, err)
			}
		}
		for i, id := range ids[:min(len(ids), maxExplained)] {
			msg := fmt.Sprintf("%s: job %d not completed, %d attempts begun", st.name, id, attempts[i])
			if st == r.ast && where != nil {
				msg += "; " + describeTask(where[id])
			}
			r.event("%s", msg)
		}
	}
}

// asynqTasksByJob finds every task of queue in Redis, by the job its
// payload carries.
func asynqTasksByJob(insp *asynq.Inspector, queue string) (map[int64]*asynq.TaskInfo, error) {
	lists := []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){
		insp.ListPendingTasks, insp.ListActiveTasks, insp.ListScheduledTasks,
		insp.ListRetryTasks, insp.ListArchivedTasks, insp.ListCompletedTasks,
	}
	out := map[int64]*asynq.TaskInfo{}
	for _, list := range lists {
		for page := 1; ; page++ {
			tasks, err := list(queue, asynq.PageSize(listPage), asynq.Page(page))
			if err != nil {
				return out, err
			}
			for _, t := range tasks {
				if p, err := decodePayload(t.Payload); err == nil {
					out[p.ID] = t
				}
			}
			if len(tasks) < listPage {
				break
			}
		}
	}
	return out, nil
}

func describeTask(t *asynq.TaskInfo) string {
	if t == nil {
		return "no task of it in Redis"
	}
	parts := []string{fmt.Sprintf("task %s %s", t.ID, t.State)}
	if t.IsOrphaned {
		parts = append(parts, "orphaned (its lease expired with no worker on it; asynq's recoverer retries it a minute or two later)")
	}
	parts = append(parts, fmt.Sprintf("retried %d of %d", t.Retried, t.MaxRetry))
	if !t.NextProcessAt.IsZero() && t.State != asynq.TaskStateActive {
		parts = append(parts, fmt.Sprintf("next run in %s", time.Until(t.NextProcessAt).Round(time.Millisecond)))
	}
	if t.LastErr != "" {
		parts = append(parts, fmt.Sprintf("last error %q", t.LastErr))
	}
	return strings.Join(parts, ", ")
}
