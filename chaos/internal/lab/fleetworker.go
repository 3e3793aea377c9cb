package lab

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// fleetWorkerEnv marks a process started as a worker of the simulation: it
// runs routers and answers the parent's commands on stdin/stdout.
const fleetWorkerEnv = "CAUGHTUP_FLEET_WORKER"

// IsFleetWorker reports whether this process was started as a worker. A
// program (or TestMain) that runs Main must call RunFleetWorker instead when it
// is: workers are the same binary, started again.
func IsFleetWorker() bool { return os.Getenv(fleetWorkerEnv) == "1" }

// fleetCommand is one request of the parent to a worker, one JSON line.
type fleetCommand struct {
	Op string `json:"op"` // start, first, wait, spike, stats, stop

	// start
	Config *fleetWorkerConfig `json:"config,omitempty"`
	// wait, spike: the token jobs carry, as header text
	Token string `json:"token,omitempty"`
	// spike: jobs per second per router, and for how long
	RatePerRouter float64       `json:"rate_per_router,omitempty"`
	Duration      time.Duration `json:"duration,omitempty"`
}

// fleetWorkerConfig is what a worker's routers are made of.
type fleetWorkerConfig struct {
	Routers  int         `json:"routers"`
	Primary  string      `json:"primary"`
	Replicas []fleetDSN  `json:"replicas"`
	Redis    string      `json:"redis"`
	Feed     string      `json:"feed"` // "": the routers poll by themselves
	Keys     string      `json:"keys"`
	Budget   fleetBudget `json:"budget"`
	// Batch routers start at a time: each polls the primary once at start
	// (and, polling by itself, every replica), so a batch costs each such
	// node that many connections.
	Batch int `json:"batch"`
}

type fleetDSN struct {
	Name string `json:"name"`
	DSN  string `json:"dsn"`
}

type fleetBudget struct {
	Rate    int           `json:"rate"`
	Burst   int           `json:"burst"`
	Timeout time.Duration `json:"timeout"`
}

// fleetReply is a worker's answer, one JSON line.
type fleetReply struct {
	Op  string `json:"op"`
	Err string `json:"err,omitempty"`

	// wait: when each router's job returned (Unix ns), and its outcome
	Woke     []int64        `json:"woke,omitempty"`
	Outcomes map[string]int `json:"outcomes,omitempty"`

	// spike: decision times (Unix ns) of the fallbacks admitted, and of
	// those a per-router token bucket with the routers' own cap alone
	// (PrimaryRate, PrimaryBurst) would have admitted from the same
	// attempts
	Admitted []int64 `json:"admitted,omitempty"`
	Shadow   []int64 `json:"shadow,omitempty"`
	Attempts int     `json:"attempts,omitempty"`
	Capped   int     `json:"capped,omitempty"`
	Errors   int     `json:"errors,omitempty"`

	// stats
	Received   int64            `json:"received,omitempty"`
	Fallbacks  uint64           `json:"fallbacks,omitempty"`
	OffFeed    int              `json:"off_feed,omitempty"`
	LocalNodes int              `json:"local_nodes,omitempty"`
	Budget     map[string]int64 `json:"budget,omitempty"`
}

// fleetWorker is one process's routers.
type fleetWorker struct {
	cfg     fleetWorkerConfig
	log     *slog.Logger
	reader  *sdkmetric.ManualReader
	mp      *sdkmetric.MeterProvider
	primary *pgxpool.Pool
	reps    []*pgxpool.Pool
	routers []*consume.Router
	clients []*redis.Client
}

// RunFleetWorker serves the parent's commands on in, answering on out, until
// "stop" or the end of in (the parent died). Logs go to logw.
func RunFleetWorker(ctx context.Context, in io.Reader, out io.Writer, logw io.Writer) int {
	w := &fleetWorker{log: slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	w.reader = sdkmetric.NewManualReader()
	w.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(w.reader))
	defer w.close()
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	enc := json.NewEncoder(out)
	var mu sync.Mutex
	send := func(r fleetReply) {
		mu.Lock()
		defer mu.Unlock()
		_ = enc.Encode(r)
	}
	for sc.Scan() {
		var c fleetCommand
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			send(fleetReply{Op: "error", Err: err.Error()})
			continue
		}
		switch c.Op {
		case "start":
			err := w.start(ctx, *c.Config)
			send(fleetReply{Op: "started", Err: errString(err)})
		case "first":
			send(fleetReply{Op: "first", Err: errString(w.first(ctx))})
		case "wait":
			w.wait(ctx, c.Token, send)
		case "spike":
			send(w.spike(ctx, c))
		case "stats":
			send(w.stats())
		case "stop":
			w.close()
			send(fleetReply{Op: "stopped"})
			return 0
		default:
			send(fleetReply{Op: "error", Err: "unknown op " + c.Op})
		}
	}
	return 0
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func (w *fleetWorker) close() {
	for _, r := range w.routers {
		_ = r.Close()
	}
	w.routers = nil
	for _, c := range w.clients {
		_ = c.Close()
	}
	w.clients = nil
	for _, p := range append(w.reps, w.primary) {
		if p != nil {
			p.Close()
		}
	}
	w.reps, w.primary = nil, nil
	_ = w.mp.Shutdown(context.Background())
}

// start makes cfg.Routers routers, cfg.Batch at a time: a router on the
// feed polls the primary once, and holds no connection once the feed
// covers it, which is what the next batch waits for; it does not connect
// to a replica before it is asked about one (first).
func (w *fleetWorker) start(ctx context.Context, cfg fleetWorkerConfig) error {
	w.cfg = cfg
	pool := func(dsn string) (*pgxpool.Pool, error) {
		pc, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			return nil, err
		}
		// The application's pools: only the lag spike's primary reads
		// use them. Each router's tracker makes its own.
		pc.MaxConns = 2
		return pgxpool.NewWithConfig(ctx, pc)
	}
	var err error
	if w.primary, err = pool(cfg.Primary); err != nil {
		return err
	}
	var reps []replay.Replica
	for _, r := range cfg.Replicas {
		p, err := pool(r.DSN)
		if err != nil {
			return err
		}
		w.reps = append(w.reps, p)
		reps = append(reps, replay.Replica{Name: r.Name, Pool: p})
	}
	dbs := map[string]replay.Database{"main": {Primary: w.primary, Replicas: reps}}
	var keys feed.Keyring
	if cfg.Feed != "" {
		k, err := feed.ParseKeys(cfg.Keys)
		if err != nil {
			return err
		}
		keys = feed.Keyring{Keys: k}
	}
	batch := max(cfg.Batch, 1)
	for from := 0; from < cfg.Routers; from += batch {
		n := min(batch, cfg.Routers-from)
		made := make([]*consume.Router, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			// Its own Redis client, so its own connections: the
			// subscription, and the budget's.
			rc := redis.NewClient(&redis.Options{Addr: cfg.Redis, PoolSize: 2, DialTimeout: 2 * time.Second, ReadTimeout: 2 * time.Second})
			w.clients = append(w.clients, rc)
			wg.Go(func() {
				c := consume.Config{
					Databases:     dbs,
					WaitBudget:    time.Minute, // jobs wait in process; never deferred here
					Logger:        w.log,
					MeterProvider: w.mp,
				}
				b, err := feed.NewBudget(feed.BudgetConfig{Client: rc, Rate: cfg.Budget.Rate, Burst: cfg.Budget.Burst, Timeout: cfg.Budget.Timeout})
				if err != nil {
					errs[i] = err
					return
				}
				c.FleetBudget = b
				if cfg.Feed != "" {
					src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rc, Feed: cfg.Feed, Keys: keys,
						Logger: w.log, MeterProvider: w.mp})
					if err != nil {
						errs[i] = err
						return
					}
					c.Tracker.Feed = &replay.FeedConfig{Source: src}
				}
				made[i], errs[i] = consume.NewRouter(ctx, c)
			})
		}
		wg.Wait()
		for _, r := range made {
			if r != nil {
				w.routers = append(w.routers, r)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return err
		}
		if cfg.Feed == "" {
			continue
		}
		deadline := time.Now().Add(2 * time.Minute)
		for _, r := range made {
			for s := r.Tracker().Feed(); !s.Active || s.LocalNodes > 0; s = r.Tracker().Feed() {
				if time.Now().After(deadline) {
					return fmt.Errorf("a router did not take every node from the feed within 2m (active %v, %d nodes local, state %s)", s.Active, s.LocalNodes, s.Health.State)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	return nil
}

// first reads every router's snapshot at once, as every router's first
// job does, and on the feed waits until each has identified its replicas
// (its own query of each, which is what the first reading asks for).
func (w *fleetWorker) first(ctx context.Context) error {
	for _, r := range w.routers {
		r.Snapshot()
	}
	if w.cfg.Feed == "" {
		return nil
	}
	deadline := time.Now().Add(2 * time.Minute)
	for _, r := range w.routers {
		for s := r.Tracker().Feed(); s.Unidentified > 0; s = r.Tracker().Feed() {
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("a router did not identify its replicas within 2m of its first job (%d nodes unidentified, %d local, state %s)", s.Unidentified, s.LocalNodes, s.Health.State)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// wait routes one Delayed job per router for tok, all at once, answers
// "waiting" once every job has been started, and "woke" with the time
// each returned once all have.
func (w *fleetWorker) wait(ctx context.Context, text string, send func(fleetReply)) {
	tok, err := position.DecodeHeaders(text)
	if err != nil {
		send(fleetReply{Op: "waiting", Err: err.Error()})
		return
	}
	woke := make([]int64, len(w.routers))
	outcomes := make([]string, len(w.routers))
	var started sync.WaitGroup
	var wg sync.WaitGroup
	started.Add(len(w.routers))
	for i, r := range w.routers {
		wg.Go(func() {
			started.Done()
			_, d, err := r.Route(ctx, consume.Job{Token: tok, Policy: consume.Delayed})
			woke[i] = time.Now().UnixNano()
			outcomes[i] = d.Outcome.String()
			if err != nil {
				outcomes[i] = "error: " + err.Error()
			}
		})
	}
	started.Wait()
	send(fleetReply{Op: "waiting"})
	go func() {
		wg.Wait()
		by := map[string]int{}
		for _, o := range outcomes {
			by[o]++
		}
		send(fleetReply{Op: "woke", Woke: woke, Outcomes: by})
	}()
}

// spike runs Sticky jobs for c.Token on every router at c.RatePerRouter
// for c.Duration, while replay is paused: each needs the primary, which
// the per-router cap and the fleet budget ration. Admitted fallbacks read
// the primary (SELECT 1 on the pool the router chose).
func (w *fleetWorker) spike(ctx context.Context, c fleetCommand) fleetReply {
	tok, err := position.DecodeHeaders(c.Token)
	if err != nil {
		return fleetReply{Op: "spiked", Err: err.Error()}
	}
	b0 := w.budgetCounts()
	var mu sync.Mutex
	var out fleetReply
	out.Op = "spiked"
	var attempts, capped, errs atomic.Int64
	end := time.Now().Add(c.Duration)
	var wg sync.WaitGroup
	every := time.Duration(float64(time.Second) / c.RatePerRouter)
	for _, r := range w.routers {
		cfg := r.Config()
		shadow := rate.NewLimiter(cfg.PrimaryRate, cfg.PrimaryBurst)
		wg.Go(func() {
			// A random phase, so that the routers' jobs do not arrive
			// in lockstep.
			next := time.Now().Add(rand.N(every))
			for {
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				if time.Now().After(end) {
					return
				}
				next = next.Add(every)
				attempts.Add(1)
				hctx, d, err := r.Route(ctx, consume.Job{Token: tok, Policy: consume.Sticky})
				at := time.Now().UnixNano()
				attempt := d.Fallback || errors.Is(err, consume.ErrCapped)
				var shadowOK bool
				if attempt {
					shadowOK = shadow.Allow()
				}
				switch {
				case errors.Is(err, consume.ErrCapped):
					capped.Add(1)
				case err != nil:
					errs.Add(1)
				case d.Fallback:
					var one int
					if qerr := consume.DB(hctx, "main").QueryRow(ctx, "SELECT 1").Scan(&one); qerr != nil {
						errs.Add(1)
					}
				}
				mu.Lock()
				if err == nil && d.Fallback {
					out.Admitted = append(out.Admitted, at)
				}
				if shadowOK {
					out.Shadow = append(out.Shadow, at)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	out.Attempts, out.Capped, out.Errors = int(attempts.Load()), int(capped.Load()), int(errs.Load())
	out.Budget = map[string]int64{}
	for k, v := range w.budgetCounts() {
		out.Budget[k] = v - b0[k]
	}
	return out
}

// budgetCounts are caughtup.consume.fallback.budget by budget/result.
func (w *fleetWorker) budgetCounts() map[string]int64 {
	return counterSums(w.reader, "caughtup.consume.fallback.budget", "caughtup.budget", "caughtup.result")
}

func (w *fleetWorker) stats() fleetReply {
	out := fleetReply{Op: "stats"}
	for _, v := range counterSums(w.reader, "caughtup.feed.received") {
		out.Received += v
	}
	for _, r := range w.routers {
		s := r.Tracker().Feed()
		out.Fallbacks += s.Fallbacks
		out.LocalNodes += s.LocalNodes
		if s.Configured && !s.Active {
			out.OffFeed++
		}
	}
	return out
}
