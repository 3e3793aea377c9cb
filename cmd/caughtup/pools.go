package main

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
)

// pools opens the connection pools of one command, each of at most
// maxConns connections, and closes them all when the command ends.
type pools struct {
	maxConns int32
	open     []*pgxpool.Pool
}

// connect opens a pool for dsn; a connection string that does not parse
// is a usage error.
func (ps *pools) connect(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, usageError{"bad connection string: " + err.Error()}
	}
	cfg.MaxConns = ps.maxConns
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		ps.open = append(ps.open, p)
	}
	return p, err
}

func (ps *pools) close() {
	for _, p := range ps.open {
		p.Close()
	}
}
