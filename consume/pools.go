package consume

import (
	"context"
	"database/sql"
	"fmt"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// Pool returns the pool a routed handler reads database from: the replica
// chosen for it, or the primary when the decision put it there or the
// token did not name it. ctx must come from Route; otherwise the error is
// ErrNotRouted. A database missing from Config.Databases returns an error
// wrapping ErrUnknownDatabase that names the configured ones.
func Pool(ctx context.Context, database string) (*pgxpool.Pool, error) {
	rv := routingFrom(ctx)
	if rv == nil {
		return nil, ErrNotRouted
	}
	db := rv.src.r.pools[database]
	if db == nil {
		return nil, rv.src.r.unknownDatabase(database)
	}
	for _, dd := range rv.d.Databases {
		if dd.Database == database && dd.replica >= 0 && int(dd.replica) < len(db.Replicas) {
			return db.Replicas[dd.replica].Pool, nil
		}
	}
	return db.Primary, nil
}

// DB is Pool for handlers that treat a missing pool as a programming
// error: it never returns nil, and panics with a message that names the
// database and the configured ones, or says that ctx was not routed.
// Handlers that would rather fail the job than the process call Pool.
func DB(ctx context.Context, database string) *pgxpool.Pool {
	p, err := Pool(ctx, database)
	if err != nil {
		panic(err)
	}
	return p
}

// SQLDB is Pool for code written against database/sql (GORM, sqlx, ent,
// bun, sqlc's database/sql mode): a *sql.DB over the same chosen pool,
// through pgx's stdlib. The router opens one per pool when it starts and
// closes them on Close; they never close the application's pools, and
// keep no idle connections of their own (the pgx pool holds them).
func SQLDB(ctx context.Context, database string) (*sql.DB, error) {
	p, err := Pool(ctx, database)
	if err != nil {
		return nil, err
	}
	return routingFrom(ctx).src.r.sqlDBs[p], nil
}

func (r *Router) unknownDatabase(database string) error {
	names := slices.Sorted(maps.Keys(r.pools))
	return fmt.Errorf("%w %q: the router knows %q (consume.Config.Databases)", ErrUnknownDatabase, database, names)
}

// openSQL opens the *sql.DB that SQLDB hands out for p. Opening one
// connects nothing: connections come from p as they are used.
func (r *Router) openSQL(p *pgxpool.Pool) {
	if _, ok := r.sqlDBs[p]; !ok && p != nil {
		r.sqlDBs[p] = stdlib.OpenDBFromPool(p)
	}
}
