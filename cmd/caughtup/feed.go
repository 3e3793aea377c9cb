package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
)

const feedSynopsis = `feed --primary URL --replica [NAME=]URL [--replica ...] [--database main]
       [--redis URL] [--redis-mode single|cluster|sentinel] [--redis-ca FILE]
       [--feed default] [--name NAME] [--keys-file FILE | $CAUGHTUP_FEED_KEYS] [--key-id ID]
       [--insecure] [--interval 10ms] [--heartbeat 100ms]
   or: caughtup feed --generate-key ID

Polls one database's primary and replicas and publishes every observation to
a caughtup position feed in Redis, for the Routers of a fleet to subscribe to
(consume.Config.Tracker.Feed). Run two or three, as sidecars or a small
deployment: they need no leader, and routers merge them. It runs until
interrupted.

Node names: routers match observations by database name and replica name, so
name replicas here as the routers do (replay.Replica.Name). A replica given
as a bare URL is named host:port after it, as replay.Replicas names plain
pools. A router ignores nodes it does not have and polls by itself any of its
nodes the feed does not cover (or that a publisher names differently): a
mismatch costs queries, never freshness.

Redis: --redis takes a go-redis URL (redis://user:password@host:6379/0, or
rediss:// for TLS; options as query parameters, e.g. ?dial_timeout=1s). With
--redis-mode cluster the URL names one seed and ?addr=host:port adds more
(redis.ParseClusterURL); with --redis-mode sentinel it names a sentinel,
?addr= adds more and ?master_name=mymaster selects the master set
(redis.ParseFailoverURL; the URL's user and password are the sentinels', add
?password= for the master's). The default is $CAUGHTUP_REDIS_URL, else
redis://127.0.0.1:6379/0: keep passwords in the environment rather than on
the command line. The Redis user needs only feed.PublisherACL's rules.

Keys: a file or $CAUGHTUP_FEED_KEYS holding "id:base64secret[,id:base64secret]"
(make one with --generate-key). The publisher signs with --key-id, default the
first; to rotate, give every router and publisher both keys, switch the
publishers' --key-id, then drop the old key. --insecure publishes unsigned
messages, which routers refuse unless they are Insecure too.`

// deployment is what the flags of caughtup feed say about one database's
// deployment: its nodes, the Redis, the feed and its keys. caughtup doctor
// takes the same flags, so that a feed's command line is checked as it is.
type deployment struct {
	primary                      string
	replicas                     stringList
	database                     string
	redisURL, redisMode, redisCA string
	feedName, name               string
	keysFile, keyID              string
	insecure                     bool
	interval, heartbeat          time.Duration
}

// register defines the flags on fs.
func (d *deployment) register(fs *flag.FlagSet) {
	fs.StringVar(&d.primary, "primary", "", "the primary's connection string (postgres://…); required")
	fs.Var(&d.replicas, "replica", replicaFlagHelp)
	fs.StringVar(&d.database, "database", "main", "the logical database name, as tokens and routers name it")
	fs.StringVar(&d.redisURL, "redis", "", "Redis URL (redis:// or rediss://); default $CAUGHTUP_REDIS_URL, else redis://127.0.0.1:6379/0")
	fs.StringVar(&d.redisMode, "redis-mode", "single", "single (one server or a managed endpoint), cluster (Redis Cluster) or sentinel (Sentinel-managed master)")
	fs.StringVar(&d.redisCA, "redis-ca", "", "PEM file of the CA that signed Redis's certificate (rediss://); default the system's")
	fs.StringVar(&d.feedName, "feed", feed.DefaultFeed, "the feed's name, as the routers' feed.SubscriberConfig.Feed")
	fs.StringVar(&d.name, "name", "", "this publisher's name, unique among the feed's publishers (default the host name)")
	fs.StringVar(&d.keysFile, "keys-file", "", "file with the keys, \"id:base64secret,…\"; default $CAUGHTUP_FEED_KEYS")
	fs.StringVar(&d.keyID, "key-id", "", "ID of the key to sign with (default the first key)")
	fs.BoolVar(&d.insecure, "insecure", false, "publish unsigned messages when no key is configured (routers must be Insecure too)")
	fs.DurationVar(&d.interval, "interval", replay.DefaultFeedInterval, "how often every node is polled (and published when it changed)")
	fs.DurationVar(&d.heartbeat, "heartbeat", replay.DefaultFeedHeartbeat, "how often a node that did not change is published anyway; keep it well below the routers' silence bound (500ms by default); negative: every poll")
}

// feedOnlyFlags are the flags of register that only the feed itself uses,
// not its nodes or its Redis: doctor checks a feed when one of them is
// given (or keys are).
var feedOnlyFlags = []string{"feed", "keys-file", "key-id", "insecure", "name", "interval", "heartbeat"}

// doctorIgnores are the feed-only flags doctor accepts, so that a feed's
// command line can be checked as it is, but does not use.
var doctorIgnores = []string{"name", "interval", "heartbeat"}

// validate checks what needs no I/O.
func (d *deployment) validate() error {
	if d.primary == "" || len(d.replicas) == 0 {
		return usageError{"--primary and at least one --replica are required"}
	}
	if d.interval <= 0 {
		return usageError{"--interval must be positive"}
	}
	if d.heartbeat == 0 {
		return usageError{"--heartbeat must not be 0 (negative publishes every poll)"}
	}
	return nil
}

// keyring loads the keys (--keys-file, else $CAUGHTUP_FEED_KEYS) and the
// signing key's ID.
func (d *deployment) keyring() (feed.Keyring, error) {
	keys, err := loadKeys(d.keysFile)
	if err != nil {
		return feed.Keyring{}, err
	}
	return feed.Keyring{Keys: keys, Current: d.keyID}, nil
}

// redisTarget is --redis, else $CAUGHTUP_REDIS_URL, else the local
// default; given says whether the flag or the environment named one.
func (d *deployment) redisTarget() (rawURL string, given bool) {
	if d.redisURL != "" {
		return d.redisURL, true
	}
	if v := os.Getenv("CAUGHTUP_REDIS_URL"); v != "" {
		return v, true
	}
	return "redis://127.0.0.1:6379/0", false
}

// redisClient builds the client --redis, --redis-mode and --redis-ca ask
// for, on rawURL.
func (d *deployment) redisClient(rawURL string) (redis.UniversalClient, error) {
	return redisClient(rawURL, d.redisMode, d.redisCA)
}

func runFeed(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(feedSynopsis, stdout)
	var d deployment
	d.register(fs)
	generate := fs.String("generate-key", "", "print a new key with this ID as \"id:base64secret\" and exit")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *generate != "" {
		k, err := feed.GenerateKey(*generate)
		if err != nil {
			return usageError{err.Error()}
		}
		fmt.Fprintln(stdout, k.Export())
		return nil
	}
	if err := d.validate(); err != nil {
		return err
	}
	replicas, err := parseReplicas(d.replicas)
	if err != nil {
		return err
	}
	ring, err := d.keyring()
	if err != nil {
		return err
	}
	if len(ring.Keys) == 0 && !d.insecure {
		return usageError{"no keys: give --keys-file or $CAUGHTUP_FEED_KEYS (make one with --generate-key), or --insecure"}
	}

	redisURL, _ := d.redisTarget()
	rdb, err := d.redisClient(redisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()

	conns := &pools{maxConns: 1} // the Publisher polls on its own connections
	defer conns.close()
	pp, err := conns.connect(ctx, d.primary)
	if err != nil {
		return err
	}
	db := replay.Database{Primary: pp}
	for _, r := range replicas {
		p, err := conns.connect(ctx, r.dsn)
		if err != nil {
			return err
		}
		db.Replicas = append(db.Replicas, replay.Replica{Name: r.name, Pool: p})
	}

	log := slog.New(slog.NewTextHandler(stderr, nil))
	snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Feed: d.feedName, Name: d.name, Keys: ring, Insecure: d.insecure, Logger: log})
	if err != nil {
		return err
	}
	pub, err := replay.NewPublisher(ctx, map[string]replay.Database{d.database: db}, replay.PublisherConfig{
		Feed:         snd,
		PollInterval: d.interval,
		Heartbeat:    d.heartbeat,
		Logger:       log,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	names := make([]string, len(db.Replicas))
	for i, r := range db.Replicas {
		names[i] = r.Name
	}
	fmt.Fprintf(stdout, "publishing database %q (primary, replicas %s) to feed %q on %s as %s: polls every %v, unchanged nodes every %v\n",
		d.database, strings.Join(names, ", "), d.feedName, feed.ChannelName(d.feedName), pub.ID(), d.interval, d.heartbeat)
	<-ctx.Done()
	return pub.Close()
}

// loadKeys reads the keys from file, or $CAUGHTUP_FEED_KEYS without one.
func loadKeys(file string) ([]feed.Key, error) {
	text := os.Getenv("CAUGHTUP_FEED_KEYS")
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, usageError{"--keys-file: " + err.Error()}
		}
		text = string(b)
	}
	keys, err := feed.ParseKeys(text)
	if err != nil {
		return nil, usageError{err.Error()}
	}
	return keys, nil
}

// redisClient builds the go-redis client --redis and --redis-mode ask for.
func redisClient(rawURL, mode, caFile string) (redis.UniversalClient, error) {
	var roots *x509.CertPool
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, usageError{"--redis-ca: " + err.Error()}
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, usageError{"--redis-ca: no PEM certificate in " + caFile}
		}
	}
	withCA := func(c *tls.Config) *tls.Config {
		if c != nil && roots != nil {
			c.RootCAs = roots
		}
		return c
	}
	bad := func(err error) error { return usageError{"--redis: " + err.Error()} }
	switch mode {
	case "single":
		o, err := redis.ParseURL(rawURL)
		if err != nil {
			return nil, bad(err)
		}
		o.TLSConfig = withCA(o.TLSConfig)
		return redis.NewClient(o), nil
	case "cluster":
		o, err := redis.ParseClusterURL(rawURL)
		if err != nil {
			return nil, bad(err)
		}
		o.TLSConfig = withCA(o.TLSConfig)
		return redis.NewClusterClient(o), nil
	case "sentinel":
		o, err := redis.ParseFailoverURL(rawURL)
		if err != nil {
			return nil, bad(err)
		}
		if o.MasterName == "" {
			return nil, usageError{"--redis-mode sentinel: add ?master_name=NAME to --redis"}
		}
		o.TLSConfig = withCA(o.TLSConfig)
		return redis.NewFailoverClient(o), nil
	}
	return nil, usageError{"--redis-mode: want single, cluster or sentinel"}
}
