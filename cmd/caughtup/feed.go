package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"

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
(consume.Config.Feed). Run two or three, as sidecars or a small deployment:
they need no leader, and routers merge them. It runs until interrupted.

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

// replicaArg is NAME=URL: a name of the characters replica names use in
// practice, then a postgres URL.
var replicaArg = regexp.MustCompile(`^([A-Za-z0-9._:@-]{1,128})=(postgres(ql)?://.*)$`)

func runFeed(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(feedSynopsis, stdout)
	var replicas stringList
	primary := fs.String("primary", "", "the primary's connection string (postgres://…); required")
	fs.Var(&replicas, "replica", "a replica: NAME=postgres://… or a bare connection string (named host:port); repeat for each")
	database := fs.String("database", "main", "the logical database name, as tokens and routers name it")
	redisURL := fs.String("redis", "", "Redis URL (redis:// or rediss://); default $CAUGHTUP_REDIS_URL, else redis://127.0.0.1:6379/0")
	redisMode := fs.String("redis-mode", "single", "single (one server or a managed endpoint), cluster (Redis Cluster) or sentinel (Sentinel-managed master)")
	redisCA := fs.String("redis-ca", "", "PEM file of the CA that signed Redis's certificate (rediss://); default the system's")
	feedName := fs.String("feed", feed.DefaultFeed, "the feed's name, as the routers' FeedConfig.Name")
	name := fs.String("name", "", "this publisher's name, unique among the feed's publishers (default the host name)")
	keysFile := fs.String("keys-file", "", "file with the keys, \"id:base64secret,…\"; default $CAUGHTUP_FEED_KEYS")
	keyID := fs.String("key-id", "", "ID of the key to sign with (default the first key)")
	insecure := fs.Bool("insecure", false, "publish unsigned messages when no key is configured (routers must be Insecure too)")
	interval := fs.Duration("interval", replay.DefaultFeedInterval, "how often every node is polled (and published when it changed)")
	heartbeat := fs.Duration("heartbeat", replay.DefaultFeedHeartbeat, "how often a node that did not change is published anyway; keep it well below the routers' silence bound (500ms by default); negative: every poll")
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
	if *primary == "" || len(replicas) == 0 {
		return usageError{"--primary and at least one --replica are required"}
	}
	if *interval <= 0 {
		return usageError{"--interval must be positive"}
	}
	if *heartbeat == 0 {
		return usageError{"--heartbeat must not be 0 (negative publishes every poll)"}
	}
	keys, err := loadKeys(*keysFile)
	if err != nil {
		return err
	}
	ring := feed.Keyring{Keys: keys, Current: *keyID}
	if len(keys) == 0 && !*insecure {
		return usageError{"no keys: give --keys-file or $CAUGHTUP_FEED_KEYS (make one with --generate-key), or --insecure"}
	}

	if *redisURL == "" {
		*redisURL = envOr("CAUGHTUP_REDIS_URL", "redis://127.0.0.1:6379/0")
	}
	rdb, err := redisClient(*redisURL, *redisMode, *redisCA)
	if err != nil {
		return err
	}
	defer rdb.Close()

	conns := &pools{maxConns: 1} // the Publisher polls on its own connections
	defer conns.close()
	pp, err := conns.connect(ctx, *primary)
	if err != nil {
		return err
	}
	db := replay.Database{Primary: pp}
	seen := make(map[string]bool)
	for _, arg := range replicas {
		rname, dsn := "", arg
		if m := replicaArg.FindStringSubmatch(arg); m != nil {
			rname, dsn = m[1], m[2]
		}
		p, err := conns.connect(ctx, dsn)
		if err != nil {
			return err
		}
		if rname == "" {
			cc := p.Config().ConnConfig
			rname = net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port)))
		}
		if seen[rname] {
			return usageError{fmt.Sprintf("two replicas named %q; name them with NAME=URL", rname)}
		}
		seen[rname] = true
		db.Replicas = append(db.Replicas, replay.Replica{Name: rname, Pool: p})
	}

	log := slog.New(slog.NewTextHandler(stderr, nil))
	pub, err := replay.NewPublisher(ctx, map[string]replay.Database{*database: db}, replay.PublisherConfig{
		Feed:         feed.SenderConfig{Client: rdb, Feed: *feedName, Name: *name, Keys: ring, Insecure: *insecure},
		PollInterval: *interval,
		Heartbeat:    *heartbeat,
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
		*database, strings.Join(names, ", "), *feedName, feed.ChannelName(*feedName), pub.ID(), *interval, *heartbeat)
	<-ctx.Done()
	return pub.Close()
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
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
