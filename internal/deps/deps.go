//go:build tools

package deps

import (
	_ "github.com/cenkalti/backoff/v4"
	_ "github.com/hibiken/asynq"
	_ "github.com/jackc/pglogrepl"
	_ "github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/segmentio/kafka-go"
	_ "github.com/stretchr/testify/require"
	_ "github.com/twmb/franz-go/pkg/kfake"
	_ "go.opentelemetry.io/otel"
	_ "go.opentelemetry.io/otel/sdk/metric"
	_ "go.uber.org/goleak"
	_ "github.com/redis/go-redis/v9"
)
