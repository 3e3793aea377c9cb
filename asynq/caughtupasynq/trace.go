package caughtupasynq

import (
	"context"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
)

// Span attributes, after OpenTelemetry's messaging conventions where they
// have a name for it.
const (
	attrMessagingSystem = "messaging.system"
	attrDestination     = "messaging.destination.name"
	attrMessageID       = "messaging.message.id"
	attrTaskType        = "caughtup.asynq.task_type"
	attrWoken           = "caughtup.asynq.woken"
)

var systemAsynq = attribute.String(attrMessagingSystem, "asynq")

// taskAttributes names the task being handled in ctx on a span.
func taskAttributes(ctx context.Context, task *asynq.Task) []attribute.KeyValue {
	attrs := []attribute.KeyValue{systemAsynq, attribute.String(attrTaskType, task.Type())}
	if q, ok := asynq.GetQueueName(ctx); ok {
		attrs = append(attrs, attribute.String(attrDestination, q))
	}
	if id, ok := asynq.GetTaskID(ctx); ok {
		attrs = append(attrs, attribute.String(attrMessageID, id))
	}
	return attrs
}
