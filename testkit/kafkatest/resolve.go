package kafkatest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// The poms are embedded so that any package's tests (whose working
// directory is their own package, not this one) and the resolve command
// see the same files, and so that their hash can name the cache entry.
//
//go:embed maven/pom.xml maven/*/pom.xml
var poms embed.FS

// installHint ends errors about a missing or unusable Java or Maven.
const installHint = "run scripts/install-deps (it installs openjdk-17-jdk-headless and maven, then resolves the jars), or see testkit/kafkatest/doc.go"

// Artifacts are the resolved jar directories.
type Artifacts struct {
	// Dir is the cache entry: <CacheDir>/kafkatest/<hash of the poms>.
	Dir string
	// Broker is the broker's classpath directory (kafka_2.13).
	Broker string
	// Connect is the Connect worker's classpath directory (connect-runtime).
	Connect string
	// Plugins is a Connect plugin.path directory holding the Debezium
	// PostgreSQL connector in a subdirectory of its own.
	Plugins string
}

func artifactsIn(dir string) *Artifacts {
	return &Artifacts{
		Dir:     dir,
		Broker:  filepath.Join(dir, "lib", "kafka"),
		Connect: filepath.Join(dir, "lib", "connect"),
		Plugins: filepath.Join(dir, "plugins"),
	}
}

// CacheDir is where resolved artifacts are kept, outside the repository so
// that every worktree and every clean checkout shares one copy:
// $CAUGHTUP_CACHE, else $XDG_CACHE_HOME/caughtup, else ~/.cache/caughtup.
func CacheDir() (string, error) {
	if d := os.Getenv("CAUGHTUP_CACHE"); d != "" {
		return d, nil
	}
	d, err := os.UserCacheDir() // $XDG_CACHE_HOME, else ~/.cache
	if err != nil {
		return "", fmt.Errorf("kafkatest: no cache directory (%w); set CAUGHTUP_CACHE", err)
	}
	return filepath.Join(d, "caughtup"), nil
}

// pomKey names the cache entry after the poms' content, so that a version
// change in a pom resolves a fresh entry instead of reusing stale jars.
func pomKey() (string, error) {
	h := sha256.New()
	err := fs.WalkDir(poms, "maven", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := poms.ReadFile(path)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", path, len(b))
		h.Write(b)
		return nil
	})
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

var resolved struct {
	mu  sync.Mutex
	art *Artifacts
}

// Resolve returns the jar directories, downloading them from Maven Central
// with mvn the first time (about a minute and 100 MB; later calls only stat
// a marker file). It is safe to call from several test binaries at once: one
// resolves under an exclusive lock on <CacheDir>/kafkatest/.lock while the
// others wait, and the finished directory appears by an atomic rename, so a
// half-resolved entry is never used even if the lock were not honoured.
// Without a deadline on ctx it gives up after 10 minutes.
func Resolve(ctx context.Context, logf func(string, ...any)) (*Artifacts, error) {
	resolved.mu.Lock()
	defer resolved.mu.Unlock()
	if resolved.art != nil {
		return resolved.art, nil
	}
	cache, err := CacheDir()
	if err != nil {
		return nil, err
	}
	key, err := pomKey()
	if err != nil {
		return nil, fmt.Errorf("kafkatest: reading embedded poms: %w", err)
	}
	base := filepath.Join(cache, "kafkatest")
	art := artifactsIn(filepath.Join(base, key))
	if complete(art) {
		resolved.art = art
		return art, nil
	}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 10*time.Minute)
	defer cancel()
	if err := os.MkdirAll(base, 0o755); err != nil {
		return nil, fmt.Errorf("kafkatest: cannot create the artifact cache (set CAUGHTUP_CACHE to a writable directory): %w", err)
	}
	unlock, err := testsvc.LockFile(ctx, filepath.Join(base, ".lock"), "resolving the Kafka jars", logf)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if complete(art) { // another process finished while we waited
		resolved.art = art
		return art, nil
	}
	began := time.Now()
	if logf != nil {
		logf("kafkatest: resolving Kafka and Debezium jars from Maven Central into %s (once; about a minute)", art.Dir)
	}
	if err := resolveInto(ctx, base, key, art.Dir); err != nil {
		return nil, err
	}
	if logf != nil {
		logf("kafkatest: resolved in %v", time.Since(began).Round(100*time.Millisecond))
	}
	resolved.art = art
	return art, nil
}

// complete reports whether a cache entry was fully resolved: the marker is
// written last, before the rename that publishes the entry.
func complete(a *Artifacts) bool {
	_, err := os.Stat(filepath.Join(a.Dir, "complete"))
	return err == nil
}

// resolveInto runs mvn into a scratch directory next to dst and renames it
// into place. Called with the lock held, so scratch directories left by a
// killed resolver are stale and removed first.
func resolveInto(ctx context.Context, base, key, dst string) error {
	if old, _ := filepath.Glob(filepath.Join(base, "*.partial")); len(old) > 0 {
		for _, o := range old {
			_ = os.RemoveAll(o)
		}
	}
	tmp := filepath.Join(base, key+"."+strconv.Itoa(os.Getpid())+".partial")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	pomDir := filepath.Join(tmp, "maven")
	err := fs.WalkDir(poms, "maven", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		out := filepath.Join(tmp, path)
		if d.IsDir() {
			return os.MkdirAll(out, 0o755)
		}
		b, err := poms.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(out, b, 0o644)
	})
	if err != nil {
		return fmt.Errorf("kafkatest: writing poms: %w", err)
	}
	mvn, err := mavenBinary()
	if err != nil {
		return err
	}
	// The local repository lives in the cache too: everything the harness
	// downloaded is under one directory, and a version bump in a pom
	// downloads only what changed.
	repo := filepath.Join(base, "m2")
	logPath := filepath.Join(tmp, "mvn.log")
	if err := testsvc.RunMaven(ctx, mvn, tmp, logPath,
		"-f", filepath.Join(pomDir, "pom.xml"),
		"-Dmaven.repo.local="+repo,
		"-Dkafkatest.lib="+filepath.Join(tmp, "lib"),
		"dependency:copy-dependencies"); err != nil {
		return fmt.Errorf("kafkatest: mvn dependency:copy-dependencies failed (%v); is Maven Central reachable? log %s:\n%s", err, logPath, testsvc.LogTailN(logPath, 0, 30))
	}
	// Connect's plugin.path wants a directory of plugin directories.
	if err := os.MkdirAll(filepath.Join(tmp, "plugins"), 0o755); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	if err := os.Rename(filepath.Join(tmp, "lib", "debezium"), filepath.Join(tmp, "plugins", "debezium-connector-postgres")); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	a := artifactsIn(tmp)
	for _, d := range []string{a.Broker, a.Connect, filepath.Join(a.Plugins, "debezium-connector-postgres")} {
		if jars, _ := filepath.Glob(filepath.Join(d, "*.jar")); len(jars) == 0 {
			return fmt.Errorf("kafkatest: mvn left no jars in %s; log %s:\n%s", d, logPath, testsvc.LogTailN(logPath, 0, 30))
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, "complete"), []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o644); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	_ = os.RemoveAll(dst) // an incomplete entry from before the rename scheme
	if err := os.Rename(tmp, dst); err != nil {
		return fmt.Errorf("kafkatest: publishing %s: %w", dst, err)
	}
	ok = true
	return nil
}

func mavenBinary() (string, error) {
	if m, ok := testsvc.FindBinary("MAVEN", "mvn"); ok {
		return m, nil
	}
	return "", errors.New("kafkatest: mvn not found on $PATH (or $MAVEN), and the Kafka jars are not in the cache yet; " + installHint)
}

var java struct {
	once sync.Once
	bin  string
	err  error
}

// javaBinary finds a Java 17+ runtime once per process: $JAVA_HOME/bin/java,
// else java on $PATH. Kafka 4 needs 17 (brokers and Connect alike).
func javaBinary() (string, error) {
	java.once.Do(func() {
		bin := ""
		if h := os.Getenv("JAVA_HOME"); h != "" {
			bin = filepath.Join(h, "bin", "java")
		} else if b, err := exec.LookPath("java"); err == nil {
			bin = b
		} else {
			java.err = errors.New("kafkatest: java not found ($JAVA_HOME, $PATH); Kafka 4 needs Java 17 or later; " + installHint)
			return
		}
		out, err := exec.Command(bin, "-XX:-UsePerfData", "-version").CombinedOutput()
		if err != nil {
			java.err = fmt.Errorf("kafkatest: %s -version failed: %v: %s; %s", bin, err, bytes.TrimSpace(out), installHint)
			return
		}
		major := javaMajor(string(out))
		if major < 17 {
			java.err = fmt.Errorf("kafkatest: %s is Java %d; Kafka 4 needs 17 or later (set JAVA_HOME); %s", bin, major, installHint)
			return
		}
		java.bin = bin
	})
	return java.bin, java.err
}

var javaVersionRE = regexp.MustCompile(`version "(1\.)?(\d+)`)

// javaMajor reads `java -version`: "17.0.15", "25", or "1.8.0_392" (8).
func javaMajor(versionOutput string) int {
	m := javaVersionRE.FindStringSubmatch(versionOutput)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[2])
	return n
}

// classpath is a directory's jars, as the JVM's wildcard would list them.
func classpath(dir string) string {
	return strings.TrimSuffix(dir, "/") + "/*"
}
