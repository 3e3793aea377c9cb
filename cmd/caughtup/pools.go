package main

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// replicaFlagHelp is the --replica flag's help, the same for every
// command that takes replicas.
const replicaFlagHelp = "a replica: NAME=postgres://… or a bare connection string (URL or key=value, named host:port); repeat for each"

// replicaName is the NAME of NAME=URL: the characters replica names use
// in practice.
var replicaName = regexp.MustCompile(`^[A-Za-z0-9._:@-]{1,128}$`)

// namedDSN is one --replica: its name and connection string.
type namedDSN struct{ name, dsn string }

// parseReplicas splits each --replica of watch, feed and doctor into its
// name and connection string: NAME=URL (postgres:// or postgresql://), or
// a bare URL or key=value string, named host:port after the first host it
// names, as replay.Replicas names plain pools. One parser for every
// command, so that a command line means the same replicas to all of them.
//
// A key=value string whose first value holds another "=" or a URL
// ("r1=host=db1 port=5432", "my replica=postgres://…") is refused: pgconn
// would take its first key as a runtime parameter and connect to the
// default host, the local socket, silently.
func parseReplicas(args []string) ([]namedDSN, error) {
	seen := make(map[string]bool)
	out := make([]namedDSN, 0, len(args))
	for _, arg := range args {
		r := namedDSN{dsn: arg}
		if name, rest, ok := strings.Cut(arg, "="); ok && !isURL(arg) {
			first, _, _ := strings.Cut(strings.TrimLeft(rest, " \t"), " ")
			switch {
			case replicaName.MatchString(name) && isURL(rest):
				r.name, r.dsn = name, rest
			case isURL(strings.TrimSpace(rest)) || (strings.Contains(first, "=") && !strings.HasPrefix(first, "'")):
				// Only the name is quoted: the rest may hold a password.
				return nil, usageError{fmt.Sprintf("--replica %s=…: a named replica is NAME=postgres://user@host:port/db, NAME 1 to 128 of [A-Za-z0-9._:@-]; or give a bare connection string", strconv.Quote(name))}
			}
		}
		cfg, err := pgconn.ParseConfig(r.dsn)
		if err != nil {
			return nil, usageError{"--replica: bad connection string: " + err.Error()}
		}
		if r.name == "" {
			r.name = net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
		}
		if seen[r.name] {
			return nil, usageError{fmt.Sprintf("two replicas named %q; name them with NAME=URL", r.name)}
		}
		seen[r.name] = true
		out = append(out, r)
	}
	return out, nil
}

func isURL(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

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
