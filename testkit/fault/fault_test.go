package fault_test

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/fault"
)

// echo serves one loopback listener that echoes every connection.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(c net.Conn) error {
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		return err
	}
	_, err := c.Read(make([]byte, 1))
	return err
}

func TestCutResetsLiveConnections(t *testing.T) {
	t.Parallel()
	addr := echo(t)
	d := fault.NewDialer(nil)
	c, err := d.DialContext(t.Context(), "tcp", addr)
	require.NoError(t, err)
	require.NoError(t, roundTrip(c))
	require.Equal(t, 1, d.Cut())
	require.Error(t, roundTrip(c))
	_, open, _ := d.Stats()
	require.Zero(t, open)
	c2, err := d.DialContext(t.Context(), "tcp", addr)
	require.NoError(t, err, "Cut does not refuse new connections")
	require.NoError(t, roundTrip(c2))
	require.NoError(t, c2.Close())
}

func TestHoldBlocksNewDialsUntilRelease(t *testing.T) {
	t.Parallel()
	addr := echo(t)
	d := fault.NewDialer(nil)
	live, err := d.DialContext(t.Context(), "tcp", addr)
	require.NoError(t, err)
	d.Hold()
	require.NoError(t, roundTrip(live), "live connections keep working while dials are held")

	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err = d.DialContext(ctx, "tcp", addr)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a held dial gives up with its context")

	got := make(chan error, 1)
	go func() {
		c, err := d.DialContext(context.Background(), "tcp", addr)
		if err == nil {
			err = roundTrip(c)
			_ = c.Close()
		}
		got <- err
	}()
	require.Eventually(t, func() bool { _, _, h := d.Stats(); return h == 1 }, time.Second, time.Millisecond)
	select {
	case err := <-got:
		t.Fatalf("held dial returned early: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	d.Release()
	require.NoError(t, <-got)
	require.NoError(t, live.Close())
}

func TestRefuse(t *testing.T) {
	t.Parallel()
	addr := echo(t)
	d := fault.NewDialer(nil)
	d.Refuse(true)
	_, err := d.DialContext(t.Context(), "tcp", addr)
	require.True(t, errors.Is(err, fault.ErrRefused), "got %v", err)
	d.Refuse(false)
	c, err := d.DialContext(t.Context(), "tcp", addr)
	require.NoError(t, err)
	require.NoError(t, c.Close())
}
