package testsvc

import (
	"context"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
)

// RunMaven runs mvn (the path FindBinary gave) with args in dir, its output
// into a new file at logPath. A nil error means mvn exited 0; on ctx's end
// the error is ctx's. Callers add what they asked for and LogTailN of the log.
//
// mvn is a shell script that execs java, so it runs in a process group of
// its own that is killed whole when ctx ends, and with Pdeathsig, so that a
// test binary killed outright leaves no mvn writing into the local
// repository the next resolver uses; Pdeathsig fires when the forking
// thread exits, hence the locked thread. -XX:-UsePerfData leaves no
// /tmp/hsperfdata_<user>/<pid> behind when mvn is killed.
func RunMaven(ctx context.Context, mvn, dir, logPath string, args ...string) error {
	lf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer lf.Close()
	cmd := exec.CommandContext(ctx, mvn, append([]string{"-B", "-q", "-Dstyle.color=never"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "MAVEN_OPTS="+strings.TrimSpace(os.Getenv("MAVEN_OPTS")+" -XX:-UsePerfData"))
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	runtime.LockOSThread()
	err = cmd.Run()
	runtime.UnlockOSThread()
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
