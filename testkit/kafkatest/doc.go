// Package kafkatest starts a real Apache Kafka 4 broker (single node, KRaft)
// and a Kafka Connect worker with the Debezium PostgreSQL connector for
// integration tests, beside testkit/pgtest and with its habits: loopback
// ports, a temp dir per service, a watchdog that cleans up even after
// SIGKILL, no Docker, and a test that fails (never skips) with the log tail
// when a service cannot start. Java is only for this harness; the product
// code stays pure Go.
//
// Tests share one broker and one worker per test binary, wired up in
// TestMain, and isolate themselves by topic, group and connector names:
//
//	func TestMain(m *testing.M) {
//		goleak.VerifyTestMain(kafkatest.Wrap(pgtest.Wrap(m, pgtest.Options{}), kafkatest.Options{}))
//	}
//
//	func TestProduce(t *testing.T) {
//		b := kafkatest.Shared(t)
//		topic := kafkatest.Name(t)
//		require.NoError(t, b.CreateTopic(ctx, topic, 3))
//		w := &kafka.Writer{Addr: kafka.TCP(b.Brokers()...), Topic: topic, ...}
//	}
//
//	func TestCDC(t *testing.T) {
//		pg := pgtest.Shared(t)
//		db := pgtest.NewDatabase(t, pg) // before the connector: cleanups run last-in first-out
//		src, _ := kafkatest.PostgresFromDSN(pg.Primary().DSN(db))
//		conn := kafkatest.NewPostgresConnector(t, kafkatest.SharedConnect(t),
//			kafkatest.DebeziumPostgres{Postgres: src, Tables: []string{"public.orders"}})
//		// Committed from here on, a change reaches conn.Topic("orders").
//	}
//
// Tests that stop, kill or restart the broker start their own with Start
// (Options.Local) and Close it in t.Cleanup.
//
// # External cluster
//
// With $KAFKA_BROKERS set (host:port, comma-separated), Start and Shared use
// that cluster and start no broker; the Connect worker still runs here.
//
// # Java and the jars
//
// Java 17 or later: $JAVA_HOME/bin/java, else java on $PATH. The jars come
// from Maven Central, resolved once with mvn from the poms in maven/
// (embedded in the package) into $CAUGHTUP_CACHE, else
// $XDG_CACHE_HOME/caughtup, else ~/.cache/caughtup: a directory named after
// the poms' hash, with lib/kafka (the broker's classpath), lib/connect (the
// worker's) and plugins/debezium-connector-postgres (a Connect plugin
// directory). Resolution takes an exclusive flock on
// <cache>/kafkatest/.lock, so concurrent test binaries resolve once, and
// publishes the directory by an atomic rename, so a half-resolved one is
// never used. Maven's local repository is <cache>/kafkatest/m2. A fresh
// machine gets Java, Maven and the jars from scripts/install-deps; without
// the jars the first test resolves them (about a minute).
//
// Versions: the broker is Kafka 4.4.0. The worker is Kafka 4.3.0, the
// release Debezium 3.6.1.Final is built against: Debezium 3.6.1 calls
// org.apache.kafka.common.utils.Sanitizer, which Kafka 4.4 moved, and its
// task dies with NoClassDefFoundError on a 4.4 worker. See maven/pom.xml.
//
// # Change events
//
// The worker's converters are JSON without schemas, so a Debezium record's
// key is the primary key ({"id":1}) and its value the bare envelope:
//
//	{"before":null,"after":{"id":1,…},"op":"c","ts_ms":…,"transaction":null,
//	 "source":{"version":"3.6.1.Final","connector":"postgresql","name":"<prefix>",
//	   "db":"…","schema":"public","table":"orders","txId":729,"lsn":22043816,
//	   "sequence":"[null,\"22043816\"]","snapshot":"false","xmin":null,…}}
//
// source.lsn is a JSON number (the change record's position, below its
// commit: design fact 2) and source.txId the 32-bit transaction id.
//
// # Files, ports, cleanup
//
// The broker and the worker each get a temp dir from testkit/testsvc
// ($PGTEST_TMPDIR, else /dev/shm when it is a big enough tmpfs) and
// 127.0.0.1 ports from the same pool as pgtest's servers. The JVMs run with
// their working directory inside it, which is how the watchdog finds them
// if the test binary dies; testkit/testsvc describes the three layers of
// cleanup. A stopped broker keeps its ports reserved until Start.
//
// # Timing
//
// On an idle 2-core machine the broker answers in about 4-6 s (1-2 s of it
// formatting the log dir in a JVM of its own), the worker in about 3 s and
// a Debezium connector streams about 1 s after it is created. Every start
// is bounded by a generous timeout (3 minutes; see Options.StartTimeout),
// because JVMs beside concurrent PostgreSQL suites start many times slower,
// and every readiness check is a real request: a metadata request listing
// the broker plus a group-coordinator round trip, GET /health on the
// worker, and the connector's walsender in state "streaming".
package kafkatest
