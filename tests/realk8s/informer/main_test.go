// Unit tests of the informer's observed watch, run by tests/test_informer.py with
// `go test` in a copy of the informer's generated module (scripts/kube_binaries.py).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// lines: the JSON lines written so far, parsed.
func lines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var parsed []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if line == "" {
			continue
		}
		var doc map[string]any
		if err := json.Unmarshal([]byte(line), &doc); err != nil {
			t.Fatalf("not a JSON line: %q: %v", line, err)
		}
		parsed = append(parsed, doc)
	}
	return parsed
}

func ofType(docs []map[string]any, kind string) []map[string]any {
	var found []map[string]any
	for _, doc := range docs {
		if doc["type"] == kind {
			found = append(found, doc)
		}
	}
	return found
}

// drain reads the observed watch's events until it closes, bounded in time.
func drain(t *testing.T, w watch.Interface) []watch.Event {
	t.Helper()
	var got []watch.Event
	timeout := time.After(5 * time.Second)
	for {
		select {
		case event, ok := <-w.ResultChan():
			if !ok {
				return got
			}
			got = append(got, event)
		case <-timeout:
			t.Fatal("the observed watch did not end within 5s")
		}
	}
}

// What client-go's stream watcher sends when the response body's read fails because
// the request's context was cancelled.
func cancelledReadEvent() watch.Event {
	err := errors.New("unable to decode an event from the watch stream: context canceled")
	return watch.Event{Type: watch.Error, Object: &apierrors.NewInternalError(err).ErrStatus}
}

func TestOwnCancellationIsNotAWatchError(t *testing.T) {
	// The informer stops: the reflector cancels the watch's context, the body read
	// fails, and the stream watcher's Error event arrives before the reflector's Stop().
	var buf bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	inner := watch.NewFakeWithChanSize(1, false)
	observed := newObservedWatch(ctx, inner, &out{w: &buf}, false)
	cancel()
	inner.Action(watch.Error, cancelledReadEvent().Object)
	inner.Stop()
	events := drain(t, observed)

	if len(events) != 1 || events[0].Type != watch.Error {
		t.Fatalf("the event is still passed on to the reflector: got %v", events)
	}
	docs := lines(t, &buf)
	if errs := ofType(docs, "WATCH_ERROR"); len(errs) != 0 {
		t.Fatalf("own cancellation reported as %v", errs)
	}
	ends := ofType(docs, "WATCH_END")
	if len(ends) != 1 || ends[0]["stoppedByClient"] != true {
		t.Fatalf("want one WATCH_END stopped by the client, got %v", docs)
	}
}

func TestServersErrorEventIsReported(t *testing.T) {
	var buf bytes.Buffer
	inner := watch.NewFakeWithChanSize(1, false)
	observed := newObservedWatch(context.Background(), inner, &out{w: &buf}, false)
	expired := &metav1.Status{Status: metav1.StatusFailure, Code: 410,
		Reason: metav1.StatusReasonExpired, Message: "too old resource version: 1 (5)"}
	inner.Action(watch.Error, expired)
	inner.Stop() // the server ends the stream
	drain(t, observed)

	docs := lines(t, &buf)
	errs := ofType(docs, "WATCH_ERROR")
	if len(errs) != 1 || errs[0]["code"] != float64(410) || errs[0]["reason"] != "Expired" {
		t.Fatalf("want the 410 Expired reported, got %v", docs)
	}
	ends := ofType(docs, "WATCH_END")
	if len(ends) != 1 || ends[0]["stoppedByClient"] != false {
		t.Fatalf("want one WATCH_END not stopped by the client, got %v", docs)
	}
}

func TestServerErrorBeforeCancellationIsReported(t *testing.T) {
	// A 500 the server sent while the client was still watching is the server's.
	var buf bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inner := watch.NewFakeWithChanSize(1, false)
	observed := newObservedWatch(ctx, inner, &out{w: &buf}, false)
	inner.Action(watch.Error, cancelledReadEvent().Object)
	<-observed.ResultChan()
	cancel()
	inner.Stop()
	drain(t, observed)

	if errs := ofType(lines(t, &buf), "WATCH_ERROR"); len(errs) != 1 || errs[0]["code"] != float64(500) {
		t.Fatalf("want the 500 reported, got %v", errs)
	}
}

func TestTaggedLinesCarryTheInformersIndex(t *testing.T) {
	// --informers N: every line of informer i says so, through the one shared writer.
	var buf bytes.Buffer
	shared := &out{w: &buf}
	shared.tagged(map[string]any{"informer": 3}).emit("SYNCED", map[string]any{"items": 2})
	shared.emit("STOPPED", map[string]any{"reason": "stdin"})

	docs := lines(t, &buf)
	if len(docs) != 2 {
		t.Fatalf("want two lines, got %v", docs)
	}
	if docs[0]["type"] != "SYNCED" || docs[0]["informer"] != float64(3) || docs[0]["items"] != float64(2) {
		t.Fatalf("want SYNCED of informer 3 with its items, got %v", docs[0])
	}
	if _, tagged := docs[1]["informer"]; tagged || docs[1]["type"] != "STOPPED" {
		t.Fatalf("want an untagged STOPPED, got %v", docs[1])
	}
}
