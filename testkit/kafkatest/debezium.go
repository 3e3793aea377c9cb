package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// Postgres is where a Debezium connector reads from: a primary with
// wal_level = logical (pgtest's primaries have it) and a user allowed to
// replicate and to create publications (pgtest's "postgres" is a superuser).
type Postgres struct {
	Host     string
	Port     int
	User     string
	Password string
	Database string
}

// PostgresFromDSN reads a libpq URL or key=value string, such as
// pgtest's Node.DSN(database).
func PostgresFromDSN(dsn string) (Postgres, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return Postgres{}, fmt.Errorf("kafkatest: %w", err)
	}
	return Postgres{Host: cfg.Host, Port: int(cfg.Port), User: cfg.User, Password: cfg.Password, Database: cfg.Database}, nil
}

func (p Postgres) connConfig() (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig("sslmode=disable")
	if err != nil {
		return nil, err
	}
	cfg.Host, cfg.Port, cfg.User, cfg.Password, cfg.Database = p.Host, uint16(p.Port), p.User, p.Password, p.Database
	cfg.ConnectTimeout = 5 * time.Second
	cfg.RuntimeParams["application_name"] = "kafkatest"
	return cfg, nil
}

func (p Postgres) connect(ctx context.Context) (*pgx.Conn, error) {
	cfg, err := p.connConfig()
	if err != nil {
		return nil, fmt.Errorf("kafkatest: %w", err)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: connect to PostgreSQL %s:%d/%s: %w", p.Host, p.Port, p.Database, err)
	}
	return conn, nil
}

// DebeziumPostgres configures a Debezium PostgreSQL source connector
// (io.debezium.connector.postgresql.PostgresConnector, plugin pgoutput).
type DebeziumPostgres struct {
	// Postgres is the database to capture. Required.
	Postgres Postgres
	// Tables are the captured tables as "schema.table"
	// (table.include.list); the publication is created for exactly these,
	// so they must exist before the connector starts. Default: every table,
	// through a FOR ALL TABLES publication (needs a superuser).
	Tables []string
	// TopicPrefix starts every topic name: changes to schema.table go to
	// "<TopicPrefix>.<schema>.<table>". Default: the connector's name.
	TopicPrefix string
	// Slot is the logical replication slot. Default: the connector's name.
	// The connector drops it when it stops (slot.drop.on.stop), because a
	// left-over slot holds WAL forever and makes DROP DATABASE fail.
	Slot string
	// Publication is the pgoutput publication, created by the connector
	// if missing. Default: the slot's name.
	Publication string
	// SnapshotMode is Debezium's snapshot.mode. Default "initial": rows
	// present at start are emitted first (op "r"), then changes. "no_data"
	// skips them.
	SnapshotMode string
	// Settings are extra connector properties, applied last (so they
	// override the above), e.g. {"decimal.handling.mode": "string"}.
	Settings map[string]string
}

// PostgresConnector is a running Debezium PostgreSQL connector.
type PostgresConnector struct {
	Name        string
	TopicPrefix string
	Slot        string
	Publication string

	c  *Connect
	pg Postgres
}

// identifier turns a name into what PostgreSQL accepts as a slot name:
// lower-case letters, digits and underscores, at most 63 bytes.
func identifier(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	out := b.String()
	if len(out) > 63 {
		out = out[:63]
	}
	return out
}

// config is the connector configuration, for CreateConnector.
func (d DebeziumPostgres) config(name string) (map[string]string, *PostgresConnector, error) {
	if d.Postgres.Host == "" || d.Postgres.Port == 0 || d.Postgres.Database == "" {
		return nil, nil, errors.New("kafkatest: DebeziumPostgres.Postgres needs Host, Port and Database (see PostgresFromDSN)")
	}
	pc := &PostgresConnector{Name: name, TopicPrefix: d.TopicPrefix, Slot: d.Slot, Publication: d.Publication, pg: d.Postgres}
	if pc.TopicPrefix == "" {
		pc.TopicPrefix = name
	}
	if pc.Slot == "" {
		pc.Slot = identifier(name)
	}
	if pc.Publication == "" {
		pc.Publication = pc.Slot
	}
	user := d.Postgres.User
	if user == "" {
		user = "postgres"
	}
	cfg := map[string]string{
		"connector.class":   "io.debezium.connector.postgresql.PostgresConnector",
		"tasks.max":         "1",
		"plugin.name":       "pgoutput",
		"database.hostname": d.Postgres.Host,
		"database.port":     strconv.Itoa(d.Postgres.Port),
		"database.user":     user,
		"database.dbname":   d.Postgres.Database,
		"topic.prefix":      pc.TopicPrefix,
		"slot.name":         pc.Slot,
		"publication.name":  pc.Publication,
		"slot.drop.on.stop": "true",
		// Debezium's queue is drained every 500 ms by default; tests wait
		// for every event.
		"poll.interval.ms": "50",
	}
	if d.Postgres.Password != "" {
		cfg["database.password"] = d.Postgres.Password
	}
	if len(d.Tables) > 0 {
		cfg["table.include.list"] = strings.Join(d.Tables, ",")
		cfg["publication.autocreate.mode"] = "filtered"
	} else {
		cfg["publication.autocreate.mode"] = "all_tables"
	}
	if d.SnapshotMode != "" {
		cfg["snapshot.mode"] = d.SnapshotMode
	}
	for k, v := range d.Settings {
		cfg[k] = v
	}
	return cfg, pc, nil
}

// StartPostgresConnector creates a Debezium PostgreSQL connector and
// returns once it streams: its snapshot (if any) is done and a change
// committed from now on will reach its topic. Delete it when done (the
// testing helper NewPostgresConnector does). On error the connector is
// deleted again.
func (c *Connect) StartPostgresConnector(ctx context.Context, name string, d DebeziumPostgres) (*PostgresConnector, error) {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	cfg, pc, err := d.config(name)
	if err != nil {
		return nil, err
	}
	pc.c = c
	began := time.Now()
	if err := c.CreateConnector(ctx, name, cfg); err != nil {
		return nil, err
	}
	if err := pc.WaitStreaming(ctx); err != nil {
		dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer dcancel()
		_ = pc.Delete(dctx)
		return nil, err
	}
	c.logf("connector %s streaming from %s:%d/%s in %v", name, d.Postgres.Host, d.Postgres.Port, d.Postgres.Database, time.Since(began).Round(time.Millisecond))
	return pc, nil
}

// Topic is the topic that receives changes to table ("schema.table", or
// "table" for public.table).
func (pc *PostgresConnector) Topic(table string) string {
	if !strings.Contains(table, ".") {
		table = "public." + table
	}
	return pc.TopicPrefix + "." + table
}

// WaitStreaming waits until the connector streams changes: the connector
// and its task are RUNNING and PostgreSQL reports the walsender holding the
// connector's slot in state "streaming". Debezium starts streaming only
// after its snapshot, and the slot (created before the snapshot) keeps
// every later commit, so from then on no change is missed or reported as
// a snapshot read. A FAILED connector or task fails at once, with the Java
// trace.
func (pc *PostgresConnector) WaitStreaming(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := pc.c.WaitRunning(ctx, pc.Name); err != nil {
		return err
	}
	conn, err := pc.pg.connect(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	last := "no slot yet"
	for {
		var state string
		err := conn.QueryRow(ctx, `SELECT coalesce(r.state, 'inactive') FROM pg_replication_slots s
			LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1`, pc.Slot).Scan(&state)
		switch {
		case err == nil && state == "streaming":
			return nil
		case err == nil:
			last = "walsender " + state
		case !errors.Is(err, pgx.ErrNoRows):
			last = err.Error()
		}
		st, serr := pc.c.Status(ctx, pc.Name)
		if serr == nil {
			if ferr := st.failure(); ferr != nil {
				return ferr
			}
		}
		if err := testsvc.SleepCtx(ctx, 100*time.Millisecond); err != nil {
			return fmt.Errorf("kafkatest: connector %q not streaming from slot %q: %w (last: %s); worker log %s:\n%s",
				pc.Name, pc.Slot, err, last, pc.c.LogPath(), testsvc.LogTailN(pc.c.LogPath(), 0, 30))
		}
	}
}

// Delete deletes the connector and makes sure its slot and publication are
// gone from PostgreSQL: the connector drops the slot as it stops, but a
// task that failed or was killed cannot, and a slot left behind holds WAL
// and makes DROP DATABASE fail.
func (pc *PostgresConnector) Delete(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	err := pc.c.DeleteConnector(ctx, pc.Name)
	conn, cerr := pc.pg.connect(ctx)
	if cerr != nil {
		return errors.Join(err, cerr)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	for {
		var exists, active bool
		qerr := conn.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1`, pc.Slot).Scan(&exists, &active)
		if qerr != nil {
			return errors.Join(err, fmt.Errorf("kafkatest: %w", qerr))
		}
		if !exists {
			break
		}
		if !active {
			// The task is gone and did not drop it (it had failed, or the
			// worker was killed).
			if _, derr := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, pc.Slot); derr == nil {
				continue
			}
		}
		if serr := testsvc.SleepCtx(ctx, 50*time.Millisecond); serr != nil {
			return errors.Join(err, fmt.Errorf("kafkatest: replication slot %q still in use after deleting connector %q: %w", pc.Slot, pc.Name, serr))
		}
	}
	if _, perr := conn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{pc.Publication}.Sanitize()); perr != nil {
		err = errors.Join(err, fmt.Errorf("kafkatest: drop publication %q: %w", pc.Publication, perr))
	}
	return err
}
